"""TensorFlow Serving's REST API for an online NeuMF (`LiveModel`), on Starlette.

- ``GET /v1/models/NAME`` (and ``/versions/V``): the version served, in TensorFlow
  Serving's ``model_version_status`` form, and beside it ``publications``: the trainer
  run, the last publication applied, its step and stream position, when the trainer
  took it and when it was applied here (`LiveModel.status`);
- ``POST /v1/models/NAME[/versions/V]:predict`` with ``signature_name``
  ``serving_default`` (inputs ``user_id``, ``item_id``) or ``recommend`` (``user_id``,
  ``k``), in the row form (``instances``: one object per user or pair; answered as
  ``predictions``, one object per instance) or the columnar form (``inputs``: one list
  per input, ``k`` a number; answered as ``outputs``).

Errors are ``{"error": "..."}`` with a 4xx status, as TensorFlow Serving answers them:
400 for a malformed request (its JSON, an unknown signature or input, an id that is no
int64, k below 1, more than `max_instances`), 404 for another model name or version,
or before any version is loaded. No request stops the server.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import AsyncIterator
from typing import Any

import anyio.to_thread
import numpy as np
import tensorflow as tf
from absl import logging
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from recommendation.serving.live_model import LiveModel

# Each signature's inputs, in order.
SIGNATURES = {"serving_default": ("user_id", "item_id"), "recommend": ("user_id", "k")}
_INT64 = (-(2**63), 2**63 - 1)
_INT32 = (-(2**31), 2**31 - 1)


class RequestError(Exception):
    """A request answered with an error: its HTTP status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _json(payload: Any, status: int = 200) -> Response:
    return Response(json.dumps(payload), status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    return _json({"error": message}, status)


def _integers(value: Any, name: str, bounds: tuple[int, int], dtype) -> np.ndarray:
    """`value` (a JSON number or list of numbers) as integers of `dtype`."""
    flat = value if isinstance(value, list) else [value]
    for item in flat:
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise RequestError(400, f'input "{name}" holds {json.dumps(item)[:40]}, not an integer')
        if isinstance(item, float) and not (math.isfinite(item) and item.is_integer()):
            raise RequestError(400, f'input "{name}" holds {item}, not an integer')
        if not bounds[0] <= item <= bounds[1]:
            raise RequestError(400, f'input "{name}" holds {item}, outside {np.dtype(dtype).name}')
    return np.asarray(
        [int(item) for item in flat] if isinstance(value, list) else int(value), dtype
    )


def _columns(instances: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The row form's instances as one list per input."""
    if not isinstance(instances, list):
        raise RequestError(400, '"instances" must be a list of objects, one per instance')
    columns: dict[str, list] = {name: [] for name in names}
    for number, instance in enumerate(instances):
        if not isinstance(instance, dict):
            raise RequestError(
                400,
                f"instance {number} is {json.dumps(instance)[:40]}: each instance is an object "
                f"of the inputs {', '.join(names)}",
            )
        _check_names(instance, names, f"instance {number}")
        for name in names:
            columns[name].append(instance[name])
    return columns


def _check_names(given: dict, names: tuple[str, ...], where: str) -> None:
    missing = [name for name in names if name not in given]
    unknown = [name for name in given if name not in names]
    if missing or unknown:
        problem = f"lacks {', '.join(missing)}" if missing else f"has no input {', '.join(unknown)}"
        raise RequestError(400, f"{where} {problem}: the inputs are {', '.join(names)}")


class PredictApi:
    """The API's answers for one model (module docstring).

    Args:
        model_name: The name requests must use.
        live: The model served.
        max_instances: Most users or pairs a request may hold.
    """

    def __init__(self, model_name: str, live: LiveModel, max_instances: int) -> None:
        self.model_name, self.live, self.max_instances = model_name, live, max_instances

    def parse(self, body: bytes) -> tuple[str, bool, dict[str, np.ndarray]]:
        """`(signature, row form, inputs)` of a predict request's body.

        Raises:
            RequestError: It is malformed (the message says how).
        """
        try:
            payload = json.loads(body)
        except ValueError as error:
            raise RequestError(400, f"JSON Parse error: {error}") from None
        if not isinstance(payload, dict):
            raise RequestError(
                400, 'the request must be a JSON object with "instances" or "inputs"'
            )
        signature = payload.get("signature_name", "serving_default")
        if signature not in SIGNATURES:
            raise RequestError(
                400,
                f"Serving signature name: {json.dumps(signature)} not found in signature def; "
                f"this model has {' and '.join(SIGNATURES)}",
            )
        names = SIGNATURES[signature]
        if ("instances" in payload) == ("inputs" in payload):
            raise RequestError(400, 'give exactly one of "instances" (rows) and "inputs" (columns)')
        row_form = "instances" in payload
        if row_form:
            columns = _columns(payload["instances"], names)
        else:
            columns = payload["inputs"]
            if not isinstance(columns, dict):
                raise RequestError(
                    400, f'"inputs" must be an object of the inputs {", ".join(names)}'
                )
            _check_names(columns, names, '"inputs"')
        inputs = {"user_id": _integers(columns["user_id"], "user_id", _INT64, np.int64)}
        if signature == "serving_default":
            inputs["item_id"] = _integers(columns["item_id"], "item_id", _INT64, np.int64)
        else:
            inputs["k"] = _integers(columns["k"], "k", _INT32, np.int32)
        return signature, row_form, self._checked(inputs)

    def _checked(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        users = inputs["user_id"]
        if users.ndim != 1:
            raise RequestError(400, 'input "user_id" must be a list of ids')
        if len(users) > self.max_instances:
            raise RequestError(
                400,
                f"{len(users):,} instances in one request: at most {self.max_instances:,} "
                "(--max_instances)",
            )
        items = inputs.get("item_id")
        if items is not None and items.shape != users.shape:
            raise RequestError(
                400, f'"user_id" and "item_id" differ in length: {len(users)} and {items.size}'
            )
        k = inputs.get("k")
        if k is not None:
            if k.ndim > 1 or (k.ndim == 1 and len(k) != len(users)):
                raise RequestError(400, 'input "k" is one number, or one per user')
            if np.any(k < 1):
                raise RequestError(400, f"k must be at least 1, got {int(k.min())}")
        return inputs

    def predict(self, body: bytes, version: str | None) -> dict:
        """The answer to a predict request (its JSON payload).

        Raises:
            RequestError: A malformed request, another version, or none loaded yet.
        """
        signature, row_form, inputs = self.parse(body)
        with self.live.reading() as served:
            if served is None:
                raise RequestError(
                    404, f"Servable not found for request: Latest({self.model_name})"
                )
            if version is not None and version != str(served.version):
                raise RequestError(
                    404, f"Servable not found for request: Specific({self.model_name}, {version})"
                )
            function = (
                served.module.serve if signature == "serving_default" else served.module.recommend
            )
            outputs = function(**{name: tf.constant(value) for name, value in inputs.items()})
            outputs = {name: value.numpy() for name, value in sorted(outputs.items())}
        if not row_form:
            return {"outputs": {name: value.tolist() for name, value in outputs.items()}}
        count = len(inputs["user_id"])
        lists = {name: value.tolist() for name, value in outputs.items()}
        return {
            "predictions": [{name: lists[name][index] for name in lists} for index in range(count)]
        }

    def status(self, version: str | None) -> dict:
        """The model's status (TensorFlow Serving's form, and its publications).

        Raises:
            RequestError: Another version, or none loaded yet.
        """
        status = self.live.status()
        if status is None or (version is not None and version != str(status["version"])):
            raise RequestError(
                404,
                f"Could not find any versions of model {self.model_name}"
                if status is None
                else f"Could not find version {version} of model {self.model_name}",
            )
        return {
            "model_version_status": [
                {
                    "version": str(status["version"]),
                    "state": "AVAILABLE",
                    "status": {"error_code": "OK", "error_message": ""},
                }
            ],
            "publications": status,
        }


def make_app(api: PredictApi, threads: int | None = None) -> Starlette:
    """The Starlette application of `api`; `threads` answer requests at once (None:
    anyio's default), and `api.live` follows its export while it runs."""

    def unknown_model(name: str) -> Response:
        return _error(404, f"Servable not found for request: Latest({name})")

    async def status(request: Request) -> Response:
        name = request.path_params["name"]
        if name != api.model_name:
            return _error(404, f"Could not find any versions of model {name}")
        try:
            return _json(api.status(request.path_params.get("version")))
        except RequestError as error:
            return _error(error.status, str(error))

    async def predict(request: Request) -> Response:
        name = request.path_params["name"]
        if name != api.model_name:
            return unknown_model(name)
        body = await request.body()
        try:
            return _json(
                await run_in_threadpool(api.predict, body, request.path_params.get("version"))
            )
        except RequestError as error:
            return _error(error.status, str(error))
        except (tf.errors.OpError, ValueError) as error:  # never expected: said, not fatal
            logging.exception("predict failed")
            return _error(500, f"the model could not answer: {str(error).splitlines()[0]}")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if threads:
            anyio.to_thread.current_default_thread_limiter().total_tokens = threads
        api.live.start()
        try:
            yield
        finally:
            api.live.stop()

    routes = [
        Route("/v1/models/{name}", status, methods=["GET"]),
        Route("/v1/models/{name}/versions/{version}", status, methods=["GET"]),
        Route("/v1/models/{name}:predict", predict, methods=["POST"]),
        Route("/v1/models/{name}/versions/{version}:predict", predict, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)
