"""NCF (NeuMF) on MovieLens, MLPerf style, and online training from event streams.

The packages follow the data flow:

- `data`: datasets, their files, preprocessing into index arrays, synthetic data;
- `producer`: the negative-sampling process, its run-folder protocol, and the
  trainer's `tf.data` side of it;
- `model`: NeuMF, its kernels, optimisers and the Estimator-style ``model_fn``;
- `training`: the NCF flags and configs and the train/eval cycles;
- `serving`: a trained NeuMF as a SavedModel (and ONNX) behind raw-id signatures;
- `online`: training from unbounded event streams (hash embeddings, sources,
  checkpoints, exports);
- `mlperf`: NCF's MLPerf tag set and compliance rules.

The modules here are the command-line programs (``ncf_main``, ``online_main``,
``create_ncf_data``, ``export``, ``recommend``). The Model Garden's module names
(``recommendation.neumf_model`` and the like) import the modules that hold their code
now (`MODEL_GARDEN_MODULES`), so code written against the Model Garden finds them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

import official  # noqa: F401 (quiets TensorFlow's INFO lines before anything imports it)

MODEL_GARDEN_MODULES = {
    "constants": "recommendation.data.constants",
    "movielens": "recommendation.data.movielens",
    "data_preprocessing": "recommendation.data.data_preprocessing",
    "stat_utils": "recommendation.producer.stat_utils",
    "data_async_generation": "recommendation.producer.data_async_generation",
    "data_pipeline": "recommendation.producer.data_pipeline",
    "neumf_model": "recommendation.model.neumf_model",
    "ncf_common": "recommendation.training.ncf_common",
}


class _ModelGardenNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``recommendation.<Model Garden name>`` as the module that holds it: the
    same module object, so that patching one patches the other."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package == __name__ and name in MODEL_GARDEN_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(MODEL_GARDEN_MODULES[spec.name.rpartition(".")[2]])

    def exec_module(self, module) -> None:
        """Nothing to run: `create_module` returned the imported module."""


sys.meta_path.append(_ModelGardenNames())
