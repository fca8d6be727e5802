"""The baselines NeuMF is measured against (ItemPop, ItemKNN, EASE, iALS), their
hyper-parameter search on the validation split, and their test evaluation, scored by
the same evaluation code as NeuMF (`recommendation.evaluation`)."""
