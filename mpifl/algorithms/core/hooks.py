"""The contract of every public method of :class:`~mpifl.algorithms.core.base.Algorithm`, in one table.

:data:`HOOKS` has one :class:`Hook` per public method, classmethod and property of ``Algorithm`` (its ``ClassVar``
data, ``norm``, ``evaluates`` ..., is documented where it is declared), by role (:data:`BY_ROLE`, :data:`ROLES`):
where in a run it works, client training, upload (the share policy), server aggregation, evaluation or the one-time
set-up.  A role lists its hooks in the order ``Algorithm``'s class body defines them, those most methods override
first, then its helpers in the order of :class:`~mpifl.algorithms.core.helpers.AlgorithmHelpers`.  Each entry says:

* ``where``: the rank on which the runtime calls it: "every rank" (``mpifl/session``, ``mpifl/transport``, or both
  server and client), "server" (rank 0, ``mpifl/server``), "client" (a client's host rank, ``mpifl/client``), or
  "internal": only other methods of ``Algorithm`` (or ``algorithms/core`` siblings) call it, and ``when`` says
  through which;
* ``when``: when it is called;
* ``chain``: a method that overrides it calls ``super()``'s (the base does work every method needs);
* ``kind``: "hook", which a method overrides to differ from FedAvg, or "helper", which the runtime or the method's
  own code calls and no method overrides.

``tests/algorithms/core/test_hooks.py`` checks the table statically: it names every public attribute once, in the
order of the class bodies (``Algorithm``'s the hooks, ``AlgorithmHelpers``' the helpers), every override of a
``chain`` hook in a registered method (mixins included) calls ``super()``, no method overrides a helper, each role's
first hook is its most overridden, and the runtime package ``where`` names calls it (an "internal" one is called by
none). What only running a method shows is checked dynamically: the guiding regularizer's chain (``begin_local``,
``extra_loss``, a method's own ``batch_loss`` adding ``plus_extra``) for every method whose download holds the classifier, in
``tests/algorithms/core/test_guide.py``
(``test_every_method_adds_the_guide_to_its_loss_or_refuses_it_in_one_line``); the share policy, aggregation, option
choices, ``fresh_optimizer`` and ``check_task`` in ``tests/algorithms/core/test_base.py``; ``norm_kind`` and
``norm_placement`` in ``tests/algorithms/test_norm_override.py``; registration in
``tests/algorithms/test_registry.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

WHERE = ("every rank", "server", "client", "internal")
KINDS = ("hook", "helper")


@dataclass(frozen=True)
class Hook:
    name: str
    where: str  # one of WHERE
    when: str
    chain: bool = False  # an override calls super()'s
    kind: str = "hook"  # one of KINDS

    def __post_init__(self):
        if self.where not in WHERE or self.kind not in KINDS:
            raise ValueError(f"{self.name}: where {self.where!r} not in {WHERE} or kind {self.kind!r} not in {KINDS}")


BY_ROLE: dict[str, tuple[Hook, ...]] = {
    "client training": (
        Hook("begin_local", "client", "per client round, after the model is loaded, before the optimizer and training",
             chain=True),
        Hook("end_local", "client", "per client round, after training and score_local('trained')"),
        Hook("after_backward", "client", "every mini-batch, between backward() and the optimizer step"),
        Hook("batch_loss", "client", "every mini-batch of local training"),
        Hook("extra_loss", "internal", "from plus_extra, every mini-batch", chain=True),
        Hook("trainable", "client", "before every local epoch, per parameter"),
        Hook("begin_round", "internal", "from enter_round, every round, after the stage and lr are set"),
        Hook("local_epochs", "client", "per client round: its number of epochs"),
        Hook("make_optimizer", "client", "per client round, after begin_local"),
        Hook("train_mode", "client", "at the start of every local training loop (a round's, a personalization's)"),
        Hook("score_local", "client", "twice per client round: 'downloaded' before begin_local, 'trained' before "
             "end_local"),
        Hook("enter_round", "every rank", "before each round's message (RoundProtocol.open)", kind="helper"),
        Hook("hold_global_head", "internal", "from begin_local", kind="helper"),
        Hook("release_global_head", "client", "per client round, when local training ends", kind="helper"),
        Hook("plus_extra", "internal", "from batch_loss (a method's own adds it)", kind="helper")),
    "upload": (
        Hook("shares", "internal", "once per stage, deriving the *_keys"),
        Hook("extra_upload", "internal", "from policy, once per stage"),
        Hook("extra_download", "internal", "from policy, once per stage"),
        Hook("extra_private", "internal", "from policy and init_client"),
        Hook("sends_back", "internal", "once per stage, deriving the *_keys"),
        Hook("phase_of", "every rank", "from enter_round, every round; once per stage when the session sizes a "
             "client's transfers for the simulated clock"),
        Hook("adopted_keys", "client", "per message on a client rank: the entries every hosted client keeps as its "
             "own"),
        Hook("derived_from_data", "internal", "from entry_spec"),
        Hook("shared_keys", "client", "per client round: the entries loaded from the download", kind="helper"),
        Hook("uploaded_keys", "client", "per client round: the model entries uploaded", kind="helper"),
        Hook("private_keys", "client", "per client round: the entries loaded from, and kept in, the private state",
             kind="helper"),
        Hook("entry_spec", "internal", "from policy: a model entry as it crosses the wire", kind="helper"),
        Hook("downloads_head", "internal", "once, when the session is built (guide.check_guide)", kind="helper"),
        Hook("policy", "every rank", "once per stage, when the session builds the stage's wire layouts",
             kind="helper")),
    "server aggregation": (
        Hook("aggregate", "server", "once per round on rank 0, after every upload is folded"),
        Hook("init_server", "server", "once on rank 0 when the run starts (a resumed run loads its checkpoint)",
             chain=True),
        Hook("gathered_keys", "internal", "from policy, reductions and aggregate"),
        Hook("reductions", "server", "once per round on rank 0: at its start, or after prepare where "
             "reductions_need_results; with --secure-aggregation on every client rank too, from the round's plan "
             "(mpifl.privacy.secure)", chain=True),
        Hook("download", "server", "every message on rank 0, before the broadcast"),
        Hook("global_value", "internal", "from aggregate, per uploaded entry"),
        Hook("client_weights", "internal", "from reductions and aggregate"),
        Hook("combine", "internal", "from aggregate, per gathered entry"),
        Hook("prepare", "server", "once per round on rank 0, after the gather, before the late reductions and "
             "aggregate"),
        Hook("concurrency", "every rank", "once, when the session builds an asynchronous method's simulated clock"),
        Hook("num_training_clients", "internal", "when a server rule needs N (deltas)", kind="helper")),
    "evaluation": (
        Hook("global_model_shared", "every rank", "once per stage, when the session spreads the global model's "
             "evaluation over the ranks"),
        Hook("global_private", "client", "per evaluated client, before its global model is evaluated"),
        Hook("personalize", "client", "per evaluated training client, before its personal model is evaluated"),
        Hook("begin_eval", "client", "per message with an evaluation, before the client rank evaluates"),
        Hook("global_eval_per_batch", "every rank", "once per stage, when the session spreads the global model's "
             "evaluation over the ranks"),
        Hook("selection", "every rank", "rank 0 picks the best round by it; under 'local-val' a client rank also "
             "scores each trained model on its val split", kind="helper"),
        Hook("selection_for", "internal", "from selection; by the report, for a finished run's config.json",
             kind="helper")),
    "one-time set-up": (
        Hook("bind_clients", "every rank", "once, when the session is built: sets training_ids", chain=True),
        Hook("adapt_model", "internal", "from network, on the seeded model, once per rank"),
        Hook("setup_exchange", "every rank", "once before round 1 (and by --show-manifest)"),
        Hook("setup_contribution", "client", "once before round 1, per hosted training client"),
        Hook("setup_received", "every rank", "once before round 1, with every training client's contribution"),
        Hook("training_data", "client", "once on a client rank, after the one-time exchanges"),
        Hook("norm_placement", "internal", "from network"),
        Hook("check_options", "internal", "from __init__ and network", kind="helper"),
        Hook("check_task", "every rank", "once, when the session is built, before the model; again in bind_task",
             kind="helper"),
        Hook("bind_task", "every rank", "once, when the session is built, after bind_clients", kind="helper"),
        Hook("norm_kind", "internal", "from network", kind="helper"),
        Hook("network", "every rank", "once, when the session builds the seeded model", kind="helper"),
        Hook("init_client", "client", "when a hosted client's private state is first made (and to check a resume)",
             kind="helper")),
}
ROLES: tuple[str, ...] = tuple(BY_ROLE)
HOOKS: tuple[Hook, ...] = tuple(hook for hooks in BY_ROLE.values() for hook in hooks)
