"""Secure aggregation (``--secure-aggregation``): rank 0 only ever holds masked uploads and their sum.

Bonawitz, Ivanov, Kreuter, Marcedone, McMahan, Patel, Ramage, Segal and Seth, "Practical Secure Aggregation for
Privacy-Preserving Machine Learning", ACM CCS 2017, simulated for real: the masks are added, travel and cancel.

For every reduction sum_k c_k x_k of a round of K clients (:mod:`mpifl.algorithms.core.reduction`), client k
sends, element by element, in the ring Z_{2^B} (B = ``--secagg-bits``),

    y_k = q_k + sum_{j > k} PRG(s_kj, r) - sum_{j < k} PRG(s_jk, r)  (mod 2^B),   q_k = round(2^f c_k x_k),

and rank 0 adds the y_k modulo 2^B: every mask comes once with each sign, so sum_k y_k = sum_k q_k (mod 2^B)
exactly, and sum_k c_k x_k ~ sum_k q_k / 2^f.  The fixed-point rule: every term must keep |c_k x_k| <= R
(``--secagg-range``; a client's upload beyond it is refused in one line naming the tensor), and

    f = B - 1 - h - ceil(log2 R),   h = bit_length(K),

so |q_k| <= 2^(B-1-h) and |sum_k q_k| < 2^(B-1): the sum of the K clients never overflows its signed B bits.  The
float64 result differs from the plain fold's by at most K / 2^(f+1) (each term's rounding) plus float64 rounding
(:attr:`SecureRound.bound`).  Words are int32 for B <= 32 (the upload's bytes as float32's), else int64.

Coefficients: each client rank computes every c_k from the round's plan, as rank 0 does
(:meth:`Algorithm.reductions` on :meth:`Uploads.planned`: the sampled clients and their sample counts, which
the Session holds alike on every rank), rather than receiving them in the download: coefficients sent by the
server could single a client out (c = 1 for it, 0 for the others would make the "sum" its upload), while
coefficients the clients derive from the public plan cannot.  So only a method whose sums read the plan alone
is accepted: one that gathers uploads whole (:meth:`Algorithm.gathered_keys`), weighs its sums by what training
returned (:attr:`Algorithm.reductions_need_results`), or reads the server's state in :meth:`Algorithm.reductions`,
is refused in one line naming what rank 0 would have to see.

Masks: the pairwise seeds s_kj come from a Diffie-Hellman key agreement (RFC 3526's 2048-bit MODP group 14,
256-bit secret exponents from :mod:`secrets`) over the one-time exchanges (:mod:`mpifl.transport.exchange`): each
training client's host rank draws its secret and contributes g^a_k; rank 0 relays the public keys and never holds
a secret, so it cannot derive a mask.  The seed of pair (k, j) in round r is SHA-256(g^(a_k a_j), r), expanded by
numpy's PCG64DXSM (the paper uses a cryptographic PRG such as AES-CTR; PCG64DXSM is not one, which a
simulation allows).
The secrets are fresh in every process, a resumed run agrees on new ones, and the numbers never depend on them:
the masks cancel exactly.

Not simulated: dropout recovery (the paper's Shamir shares of the secrets and of self-masks), since no client
drops out of a round here, and the clients' records (``client.meta``: sample and step counts, training loss and
accuracy counts), which still reach rank 0 per client, for the run log's training scalars; nor does it hide what
a method's one-time exchange shares in the clear (FedMix's mean images, FedRDN's statistics).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import hashlib
import math
import secrets
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from ..algorithms import Algorithm, Reduction, ServerState, Uploads
from ..errors import MpiflError
from ..plan.config import RunConfig
from ..transport.messages import Messages
from ..transport.wire import TensorSpec, WireLayout

#: RFC 3526's 2048-bit MODP group (id 14), generator 2
MODP_2048 = int(
    "FFFFFFFFFFFFFFFFC90FDAA22168C234C4C6628B80DC1CD129024E088A67CC74020BBEA63B139B22514A08798E3404DDEF9519B3CD3A4"
    "31B302B0A6DF25F14374FE1356D6D51C245E485B576625E7EC6F44C42E9A637ED6B0BFF5CB6F406B7EDEE386BFB5A899FA5AE9F24117C4B"
    "1FE649286651ECE45B3DC2007CB8A163BF0598DA48361C55D39A69163FA8FD24CF5F83655D23DCA3AD961C62F356208552BB9ED52907709"
    "6966D670C354E4ABC9804F1746C08CA18217C32905E462E36CE3BE39E772C180E86039B2783A2EC07A28FB5C55DF06F4C52C9DE2BCBF695"
    "5817183995497CEA956AE515D2261898FA051015728E5A8AACAA68FFFFFFFFFFFFFFFF", 16)
KEY_BYTES = 256
MASK_BLOCK = 1 << 15  # elements quantized or masked at a time: a block and its streams stay in the L2 cache
PUBLIC_KEY = TensorSpec("secagg.public_key", (KEY_BYTES,), torch.uint8)


def fraction_bits(bits: int, clients: int, value_range: float) -> int:
    """f = B - 1 - bit_length(K) - ceil(log2 R): the fixed-point scale 2^f at which K terms of magnitude <= R
    sum without overflowing B signed bits."""
    return bits - 1 - clients.bit_length() - math.ceil(math.log2(value_range))


class _Unseen(dict):
    """The server state as a client rank sees it: nothing (reading it is refused)."""

    def __init__(self, method: str):
        super().__init__()
        self.method = method

    def __missing__(self, key):
        raise MpiflError(f"--secure-aggregation: {self.method}'s reductions read the server's state ({key}), which "
                         "the clients computing their coefficients do not hold; drop --secure-aggregation")


class SecureAggregation:
    """A run's secure aggregation, the same object on every rank: the refusal of a method it cannot serve, the
    key agreement (a one-time exchange), and each round's :class:`SecureRound`."""

    def __init__(self, cfg: RunConfig, algo: Algorithm, training_ids: Sequence[int], planned: Uploads,
                 reductions: Callable[[ServerState, Uploads], dict[str, Reduction]]):
        self.bits, self.range = cfg.secagg_bits, cfg.secagg_range
        self.word = np.int32 if self.bits <= 32 else np.int64
        self.algo = algo
        self.reductions = reductions  # the run's sums (the session's: as a privacy mechanism makes them)
        self.training_ids = [int(c) for c in training_ids]
        self.check(algo)
        clients = len(planned.clients)
        if clients < 2:
            raise MpiflError(f"--secure-aggregation hides each upload in the sum of a round's clients, and this run "
                             f"samples {clients} per round, whose sum is its upload; raise --fraction")
        f = fraction_bits(self.bits, clients, self.range)
        if f < 1:
            raise MpiflError(f"--secagg-bits {self.bits} leaves {f} fraction bits for {clients} clients a round "
                             f"and --secagg-range {self.range}; raise --secagg-bits or lower --secagg-range")
        self.coefficients(planned)  # a method reading the server's state is refused before the run starts
        self.round_clients = clients
        self._secret: dict[int, int] = {}  # this rank's training clients' secret exponents
        self._public: dict[int, int] = {}  # every training client's public key
        self._shared: dict[tuple[int, int], bytes] = {}  # (this rank's client, other client): g^(a_k a_j)

    def describe(self) -> str:
        """Its line in ``log.txt``: the ring, the fixed point and the bound on each sum's difference from the plain
        fold."""
        k = self.round_clients
        f = fraction_bits(self.bits, k, self.range)
        return (f"secure aggregation: masked uploads in Z_2^{self.bits} ({np.dtype(self.word).name} words), fixed "
                f"point 2^-{f} for {k} clients a round and |c_k x_k| <= {self.range}: each sum within "
                f"{k * 2.0 ** -(f + 1):.3g} of the plain fold")

    @staticmethod
    def check(algo: Algorithm) -> None:
        """Refuse, in one line, a method whose server rule needs to see an individual upload (its current stage)."""
        gathered = algo.policy().gathered
        why = (f"each client's {', '.join(gathered)} whole (its gathered_keys)" if gathered else
               "each client's upload, to weigh it by what training returned (its reductions_need_results)"
               if algo.reductions_need_results else "")
        if why:
            raise MpiflError(f"--secure-aggregation: {algo.name}'s server rule needs rank 0 to see {why}, which "
                             "secure aggregation hides; drop --secure-aggregation or pick another --algo")

    def coefficients(self, planned: Uploads) -> dict[str, Reduction]:
        """The round's reductions from its plan alone, as rank 0 computes them (:meth:`Server._fold`)."""
        unseen = _Unseen(self.algo.name)
        return self.reductions(ServerState(model=unseen, extra=unseen), planned)

    def messages(self, messages: Messages, planned: Uploads) -> Messages:
        """A stage's layouts with the point-to-point upload replaced by its masked words: one tensor per
        reduction, of its upload's shape, named as the reduction."""
        self.check(self.algo)
        shapes = {spec.name: spec.shape for spec in messages.summed.specs}
        dtype = torch.int32 if self.word is np.int32 else torch.int64
        masked = copy.copy(messages)
        masked.summed = WireLayout(TensorSpec(name, shapes[r.upload], dtype)
                                   for name, r in self.coefficients(planned).items())
        return masked

    # ------------------------------------------------------------------ the key agreement (a one-time exchange)
    def setup_exchange(self) -> TensorSpec:
        return PUBLIC_KEY

    def setup_contribution(self, client, data) -> torch.Tensor:
        """Client k's public key g^a_k, its secret a_k kept on this rank."""
        secret = self._secret[client.id] = secrets.randbits(256)
        return torch.frombuffer(bytearray(pow(2, secret, MODP_2048).to_bytes(KEY_BYTES, "big")), dtype=torch.uint8)

    def setup_received(self, everyone: torch.Tensor) -> None:
        self._public = {c: int.from_bytes(bytes(row.numpy()), "big") for c, row in zip(self.training_ids, everyone)}

    def pair_seed(self, mine: int, other: int, round_index: int) -> int:
        """The seed both clients of a pair derive in round r: SHA-256(g^(a_k a_j), r); only their ranks can."""
        key = (mine, other)
        if key not in self._shared:
            self._shared[key] = pow(self._public[other], self._secret[mine], MODP_2048).to_bytes(KEY_BYTES, "big")
        return int.from_bytes(hashlib.sha256(self._shared[key] + round_index.to_bytes(8, "little")).digest(), "little")

    def open(self, round_index: int, reductions: Mapping[str, Reduction], messages: Messages) -> SecureRound:
        """Round r's masking (a client rank) or unmasking (rank 0) of ``reductions`` into the stage's masked
        ``messages`` (:meth:`messages`)."""
        if set(reductions) != set(messages.summed.names):
            raise RuntimeError(f"round {round_index}'s reductions {sorted(reductions)} are not its stage's "
                               f"{sorted(messages.summed.names)}")
        return SecureRound(self, round_index, dict(reductions), messages)


class SecureRound:
    """One round's fixed point and masks over its K clients."""

    def __init__(self, secure: SecureAggregation, round_index: int, reductions: dict[str, Reduction],
                 messages: Messages):
        self.secure, self.round, self.reductions = secure, round_index, reductions
        self.layout, self.kept = messages.summed, messages.client.names  # masked words; records (and gathered)
        self.clients = len(next(iter(reductions.values())).coefficients) if reductions else 0
        self.fraction = fraction_bits(secure.bits, self.clients, secure.range)
        self.bound = self.clients * 2.0 ** -(self.fraction + 1)  # |dequantized - exact| per element, at most

    @property
    def folded(self) -> dict[str, Reduction]:
        """What rank 0 folds: each masked tensor summed modulo 2^w (no coefficient, :func:`fold_ranges`)."""
        return {name: Reduction(name, None) for name in self.reductions}

    def mask(self, sampled: Sequence[int], client: int, upload: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Client ``client``'s upload as it is packed: its records, and y_k (the masked words) by reduction in place
        of its tensors (``sampled``: the round's clients, ascending)."""
        k = list(sampled).index(client)
        words = np.empty(sum(spec.numel for spec in self.layout.specs), dtype=self.secure.word)
        masked, start = {}, 0
        for spec in self.layout.specs:
            reduction = self.reductions[spec.name]
            masked[spec.name] = words[start:start + spec.numel]
            self._quantize(upload[reduction.upload], reduction.coefficients[k], masked[spec.name], client,
                           reduction.upload)
            start += spec.numel
        self._add_masks(words, [int(c) for c in sampled], client)
        return ({name: upload[name] for name in self.kept}
                | {spec.name: torch.from_numpy(masked[spec.name].reshape(spec.shape)) for spec in self.layout.specs})

    def _quantize(self, tensor: torch.Tensor, coefficient: float, out: np.ndarray, client: int, name: str) -> None:
        """out = round(2^f c x) of one upload, a cache-sized block at a time; |c x| beyond R is refused."""
        x = tensor.detach().reshape(-1).cpu()
        x = (x if x.dtype in (torch.float32, torch.float64) else x.double()).numpy()
        term = np.empty(min(MASK_BLOCK, x.size), dtype=np.float64)
        c, scale, bound = np.float64(coefficient), 2.0 ** self.fraction, self.secure.range
        for low in range(0, x.size, MASK_BLOCK):
            part = term[:min(MASK_BLOCK, x.size - low)]
            np.copyto(part, x[low:low + part.size])
            part *= c
            least, most = part.min(), part.max()
            if not (np.isfinite(least) and np.isfinite(most)):
                raise MpiflError(f"--secure-aggregation: client {client}'s {name!r} is not finite, which fixed point "
                                 "cannot represent: its training diverged; lower --lr")
            if not (-bound <= least and most <= bound):
                raise MpiflError(f"--secure-aggregation: client {client}'s {name!r} times its coefficient reaches "
                                 f"{most if abs(most) > abs(least) else least}, beyond --secagg-range {bound}; raise "
                                 "--secagg-range (each doubling costs a bit of precision) or --secagg-bits")
            part *= scale
            out[low:low + part.size] = np.rint(part, out=part)

    def _add_masks(self, words: np.ndarray, sampled: list[int], client: int) -> None:
        """words += sum_{j > k} PRG(s_kj) - sum_{j < k} PRG(s_jk), modulo 2^B, on the client rank's torch threads
        (``--threads``, idle while it masks), each a run of blocks whose streams it advances to: the same words
        for any number of threads."""
        seeds = [(self.secure.pair_seed(client, other, self.round), np.add if other > client else np.subtract)
                 for other in sampled if other != client]
        blocks = -(-words.size // MASK_BLOCK)
        parts = max(1, min(torch.get_num_threads(), blocks))
        cuts = [min(blocks * i // parts * MASK_BLOCK, words.size) for i in range(parts + 1)]
        with concurrent.futures.ThreadPoolExecutor(parts - 1) if parts > 1 else contextlib.nullcontext() as pool:
            others = [pool.submit(_mask_run, words, seeds, low, high) for low, high in zip(cuts[1:-1], cuts[2:])]
            _mask_run(words, seeds, cuts[0], cuts[1])
            for future in others:
                future.result()
        if self.secure.bits < 8 * words.itemsize:
            words &= (1 << self.secure.bits) - 1

    def sums(self, folded: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The float64 sums sum_k q_k / 2^f from rank 0's modular sums of the y_k (signed B bits)."""
        shift = 8 * np.dtype(self.secure.word).itemsize - self.secure.bits
        unsigned = np.uint32 if self.secure.word is np.int32 else np.uint64
        out = {}
        for name, total in folded.items():
            signed = (total.view(unsigned) << unsigned(shift)).view(self.secure.word) >> shift
            out[name] = np.ldexp(signed.astype(np.float64), -self.fraction)
        return out


def _mask_run(words: np.ndarray, seeds: list, start: int, stop: int) -> None:
    """Add each pair's stream, with its sign, to ``words[start:stop]`` (``start`` a block boundary), a cache-sized
    block at a time; both clients of a pair draw the same blocks of their stream."""
    per_draw = 8 // words.itemsize  # words per 64-bit draw
    streams = [(np.random.PCG64DXSM(seed).advance(start // per_draw), sign) for seed, sign in seeds]
    for low in range(start, stop, MASK_BLOCK):
        block = words[low:min(low + MASK_BLOCK, stop)]
        for prg, sign in streams:
            sign(block, prg.random_raw(-(-block.size // per_draw)).view(words.dtype)[:block.size], out=block)
