"""Secure aggregation: masked uploads whose modular sum is exactly the sum of the quantized ones, within the
quantization bound of the plain float64 fold; every registered method served or refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpifl.algorithms import REGISTRY, ClientState, Reduction
from mpifl.algorithms.core.reduction import weighted_sum
from mpifl.data import ensure_dataset
from mpifl.errors import MpiflError
from mpifl.job.cli import configuration
from mpifl.privacy.secure import MASK_BLOCK
from mpifl.server.folding import Folding, FoldThreads
from mpifl.session.session import make_session
from mpifl.transport.messages import CLIENT_META, Messages

from ..algorithms.helpers import own_options
from ..conftest import run_here
from ..rundir.test_directory import one_error


def _session(data_root, *extra, algo="fedavg", hosts=1):
    cfg, _ = configuration(["--data-root", str(data_root), "--model", "smallcnn", "--algo", algo, "--threads", "1",
                            "--clients-per-domain", "2", "--fraction", "0.5", "--secure-aggregation", *extra])
    return make_session(cfg, ensure_dataset(cfg.data_root, cfg.data), num_hosts=hosts)


def _agree(session):
    """The key agreement of every training client, all hosted here (in a run rank 0 holds no secret)."""
    secure = session.secure
    keys = [secure.setup_contribution(ClientState(spec=session.clients[c], private={}), None)
            for c in session.training_ids]
    secure.setup_received(torch.stack(keys))
    return secure


def _round(session, r, scale=0.5, seed=0):
    """Round r as the clients and rank 0 compute it: the plain uploads, what each client sends (its quantized
    words before and after its masks), the plain float64 fold and rank 0's secure sums."""
    session.algo.enter_round(r)
    secure, masked_messages = _agree(session), session.messages()
    plain = Messages(session.algo.policy(), session.evaluation().personal_kinds)
    sampled = [int(c) for c in session.sampled(r)]
    reductions = secure.coefficients(session.planned(r))
    rng = np.random.default_rng(seed)
    uploads = [{s.name: torch.from_numpy(rng.normal(0, scale, s.shape).astype(np.float32)) for s in plain.summed.specs}
               | {"client.meta": torch.zeros(len(CLIENT_META.names), dtype=torch.float64)} for _ in sampled]
    client_side = secure.open(r, reductions, masked_messages)
    quantized, sent = [], []
    add_masks = client_side._add_masks

    def keep_quantized(words, *args):
        quantized.append(words.copy())
        add_masks(words, *args)

    client_side._add_masks = keep_quantized
    for c, upload in zip(sampled, uploads):
        buffer = masked_messages.summed.empty()
        masked = client_side.mask(sampled, c, upload)
        masked_messages.summed.pack({n: masked[n] for n in masked_messages.summed.names}, out=buffer)
        sent.append(buffer)
    received = [masked_messages.summed.unpack(b) for b in sent]
    server_side = secure.open(r, secure.coefficients(session.planned(r)), masked_messages)
    folding = Folding(server_side.folded)
    folding.add(received)
    folded = {name: total.copy() for name, total in folding.sums.items()}
    fold = Folding(reductions)
    fold.add([{n: u[n].numpy() for n in plain.summed.names} for u in uploads])
    return dict(sampled=sampled, reductions=reductions, quantized=quantized, sent=sent, folded=folded,
                secure=server_side.sums(folded), plain=fold.sums, bound=server_side.bound)


@pytest.mark.parametrize("bits", [32, 64])
def test_rank_0_holds_only_masked_uploads_whose_modular_sum_is_the_quantized_sum_exactly(data_root, bits):
    result = _round(_session(data_root, "--secagg-bits", str(bits)), 1)
    word = np.int32 if bits == 32 else np.int64
    quantized = np.stack(result["quantized"])
    sent = np.stack([b[:quantized.shape[1] * quantized.itemsize].view(word) for b in result["sent"]])
    assert quantized.dtype == sent.dtype == word and len(sent) == len(result["sampled"]) == 5
    assert (sent == quantized).mean() < 1e-3  # each received upload differs from the client's own words
    bits_set = np.unpackbits(sent.view(np.uint8), axis=1).mean(axis=1)  # and its bits look uniform
    assert np.all(np.abs(bits_set - 0.5) < 0.01), bits_set
    total = quantized.sum(axis=0, dtype=word)  # wraps modulo 2^w like the fold
    assert np.array_equal(np.concatenate([f.reshape(-1) for f in result["folded"].values()]), total)
    masks_alone = (sent - quantized).sum(axis=0, dtype=word)
    assert not masks_alone.any()


@pytest.mark.parametrize("bits", [32, 64])
def test_the_masks_are_the_same_words_on_any_number_of_threads(data_root, bits, monkeypatch):
    """The client rank masks on its torch threads, each a run of blocks: one thread or three, the same words."""
    session = _session(data_root, "--secagg-bits", str(bits))
    secure, sampled = _agree(session), [int(c) for c in session.sampled(1)]
    round_ = secure.open(1, secure.coefficients(session.planned(1)), session.messages())
    size = 5 * MASK_BLOCK + 3  # blocks shared unevenly, a short last block
    masked = {}
    for threads in (1, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        masked[threads] = words = np.zeros(size, dtype=secure.word)
        round_._add_masks(words, sampled, sampled[1])
    assert masked[1].any() and np.array_equal(masked[1], masked[3])


@pytest.mark.parametrize("algo", ["fedavg", "feddyn", "scaffold", "feddc"])
@pytest.mark.parametrize("bits", [24, 32, 48, 64])
def test_secure_sums_are_within_the_quantization_bound_of_the_plain_fold(data_root, algo, bits):
    """FedDyn and FedDC sum one upload twice with different coefficients: one masked tensor per reduction."""
    result = _round(_session(data_root, "--secagg-bits", str(bits), algo=algo), 2, seed=bits)
    assert set(result["secure"]) == set(result["plain"]) == set(result["reductions"])
    for name, plain in result["plain"].items():
        error = np.abs(result["secure"][name] - plain).max()
        assert error <= result["bound"] + 1e-15 * max(1.0, np.abs(plain).max()), (name, error, result["bound"])
    assert result["bound"] == 5 * 2.0 ** -(bits - 1 - 3 - 4 + 1)  # K = 5: 3 bits of headroom; R = 16: 4


def test_the_modular_fold_is_the_same_for_any_window_and_threads():
    rng = np.random.default_rng(1)
    values = [rng.integers(-2**63, 2**63 - 1, 100_003, dtype=np.int64) for _ in range(4)]
    expected = np.sum(values, axis=0, dtype=np.int64)
    with FoldThreads(3) as threads:
        folding = Folding({"x": Reduction("x", None)}, threads)
        folding.add([{"x": values[0]}])
        folding.add([{"x": v} for v in values[1:]])
    assert np.array_equal(folding.sums["x"], expected)
    assert np.array_equal(weighted_sum([v.astype(np.float64) for v in values], [1.0] * 4),
                          np.sum([v.astype(np.float64) for v in values], axis=0))


def test_a_weighted_term_beyond_the_range_is_refused_naming_the_tensor(data_root):
    session = _session(data_root, "--secagg-range", "0.01")
    with pytest.raises(MpiflError, match=r"client \d+'s '.*' times its coefficient reaches .* --secagg-range 0.01"):
        _round(session, 1, scale=1.0)
    with pytest.raises(MpiflError, match="not finite|reaches nan"):
        _round(_session(data_root), 1, scale=np.nan)


def test_every_registered_method_is_served_or_refused_in_one_line(data_root, style_model):
    """Served: its sums read the plan alone, and a round's secure sums are the plain fold's within the bound.
    Refused: one line naming what rank 0 would have to see, read from the method's declared hooks."""
    served, refused = {}, {}
    for algo in sorted(REGISTRY):
        try:
            served[algo] = _session(data_root, *own_options(algo, style_model), algo=algo)
        except MpiflError as exc:
            refused[algo] = str(exc)
    for algo, session in served.items():
        assert not session.algo.reductions_need_results and not session.algo.gathered_keys()
        result = _round(session, 1)
        for name, plain in result["plain"].items():
            assert np.abs(result["secure"][name] - plain).max() <= result["bound"] + 1e-15, (algo, name)
    for algo, message in refused.items():
        if REGISTRY[algo].asynchronous:  # its clients go missing from the sums by design
            assert message.startswith(f"--secure-aggregation: --algo {algo} lets sampled clients go missing")
            continue
        assert "\n" not in message and message.startswith(f"--secure-aggregation: {algo}'s server rule needs rank "
                                                           "0 to see each client's"), message
        assert message.endswith("drop --secure-aggregation or pick another --algo"), message
        assert ("gathered_keys" in message) != ("reductions_need_results" in message), message
    assert "fedavg" in served and {"copa", "fedproto", "fednova", "feddg-ga"} <= set(refused), (served, refused)


def test_bad_options_and_a_round_of_one_client_are_refused_in_one_line_before_anything_is_written(data_root, tmp_path):
    base = ["--data-root", str(data_root), "--model", "smallcnn", "--threads", "1", "--secure-aggregation"]
    for extra, named in [(("--secagg-bits", "8"), "--secagg-bits must be in [16, 64], got 8"),
                         (("--secagg-range", "0"), "--secagg-range must be > 0"),
                         (("--fraction", "0.1"), "samples 1 per round"),
                         (("--secagg-bits", "16", "--secagg-range", "8192"), "leaves -1 fraction bits for 5"),
                         (("--algo", "fedproto"), "fedproto's server rule needs rank 0 to see each client's")]:
        run = tmp_path / "-".join(extra)
        job = run_here(*base, "--out", str(run), *extra)
        assert job.returncode == 2
        one_error(job, named)
        assert not run.exists()

