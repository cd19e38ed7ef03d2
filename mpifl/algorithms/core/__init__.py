"""The machinery every method stands on: the :class:`~.base.Algorithm` interface and its hooks, reductions,
model deltas, held-out evaluation, the guiding regularizer, the personalization boundary, and the options
several methods share."""
