"""tensord's load-test workloads: plain classes over the SDK, no Locust, no gevent.

Each workload is one client session doing one kind of allocation pattern.  It
calls the SDK through :meth:`Workload.call`, which times the operation and
hands ``(op, seconds, nbytes, exception, expected)`` to a recorder: Locust's
request event in ``locustfile.py``, a plain list in the tests.

Errors a workload provokes on purpose are *expected* (an OOM when the pool is
full, NOT_FOUND when another user deleted the name it was about to read); they
are recorded as such and the workload carries on.  Any other error is recorded
as a failure and raised as :class:`OpFailed`, which ends the current step.

Sizes are in bytes and scale with ``scale`` (1.0: the defaults here, sized so
that 50 users of the default mix allocate about 0.75 GiB at their peak: close
enough to ``tensord loadtest``'s default 1 GiB pool for retries and OOMs to show).
"""

from __future__ import annotations

import gzip
import json
import os
import random
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from tensord import dtypes
from tensord.errors import FailedPreconditionError, NotFoundError, OutOfMemoryError

from tensord_server.data import DEFAULT_TRACE_NAME, bundled_trace, resolve_trace

#: (op, seconds, response bytes, exception or None, expected?)
Recorder = Callable[[str, float, int, BaseException | None, bool], None]

#: every workload may meet a full pool; that is the load test's finding, not a failure
ALWAYS_EXPECTED: tuple[type[BaseException], ...] = (OutOfMemoryError,)

#: the trace the ``trace`` users replay unless told otherwise: the bundled ResNet-50 run
DEFAULT_TRACE: Path = bundled_trace(DEFAULT_TRACE_NAME)

MiB = 1 << 20
KiB = 1 << 10


class OpFailed(Exception):
    """An operation failed unexpectedly; it has already been recorded."""

    def __init__(self, op: str, cause: BaseException) -> None:
        super().__init__(f"{op}: {type(cause).__name__}: {cause}")
        self.op = op
        self.cause = cause


class DataMismatch(AssertionError):
    """Bytes read back from the server differ from what the workload computed."""


def result_nbytes(result: Any) -> int:
    """Bytes a result covers: a tensor's or array's ``nbytes``, else 0."""
    nbytes = getattr(result, "nbytes", 0)
    return nbytes if isinstance(nbytes, int) else 0


class Workload:
    """One session's worth of one allocation pattern.

    ``start()`` once, ``step()`` repeatedly, ``stop()`` once: ``stop`` drops every
    tensor and name the workload holds, so a finished workload leaks nothing.
    """

    name: ClassVar[str]
    #: relative share of users when the operator does not say otherwise
    default_weight: ClassVar[int] = 1
    #: runs against the nodes of a cluster only (``tensord loadtest`` refuses it otherwise)
    needs_cluster: ClassVar[bool] = False

    def __init__(
        self,
        client: Any,
        record: Recorder,
        *,
        rng: random.Random | None = None,
        scale: float = 1.0,
        run_id: str = "run",
        device: str = "cpu",
    ) -> None:
        self.client = client
        self.device = device  # where every tensor of this workload lives
        self.record = record
        self.rng = rng or random.Random()
        self.scale = scale
        self.run_id = run_id
        self.user_id = uuid.uuid4().hex[:12]

    # -- plumbing ---------------------------------------------------------------
    def call(
        self,
        op: str,
        fn: Callable[..., Any],
        *args: Any,
        expect: tuple[type[BaseException], ...] = (),
        **kwargs: Any,
    ) -> Any:
        """Run ``fn``, record it as ``op``; None when it raised an expected error."""
        start = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        except ALWAYS_EXPECTED + expect as exc:
            self.record(op, time.perf_counter() - start, 0, exc, True)
            return None
        except Exception as exc:
            self.record(op, time.perf_counter() - start, 0, exc, False)
            raise OpFailed(op, exc) from exc
        self.record(op, time.perf_counter() - start, result_nbytes(result), None, False)
        return result

    def verify(self, op: str, ok: bool, message: str) -> None:
        """Record a data check as its own op; a mismatch is an unexpected failure."""
        if ok:
            self.record(op, 0.0, 0, None, False)
            return
        exc = DataMismatch(message)
        self.record(op, 0.0, 0, exc, False)
        raise OpFailed(op, exc)

    def size(self, nbytes: float) -> int:
        """A size from this module's defaults, scaled, at least one byte."""
        return max(1, int(nbytes * self.scale))

    # -- the pattern ------------------------------------------------------------
    def start(self) -> None:
        """Allocate what lives for the whole session (nothing by default)."""

    def step(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        """Drop every tensor (the SDK releases the handles)."""


class KVCache(Workload):
    """LLM serving: sequences grow token by token and finish out of order.

    Half the sequences grow by ``cat`` (a new Storage each time); the other half
    write into a preallocated buffer through ``narrow().copy_()`` and double it
    when full, as paged servers do.  A sequence finishes when it reaches its
    own random target length, or is preempted, so releases come out of order.
    """

    name = "kv"
    default_weight = 3
    max_sequences = 4
    token_bytes = 2 * KiB  # one token's keys and values for every head, float16

    def start(self) -> None:
        self.width = max(1, self.size(self.token_bytes) // 2)  # float16 elements
        self.seqs: list[dict[str, Any]] = []

    def step(self) -> None:
        rng = self.rng
        if len(self.seqs) < self.max_sequences and (not self.seqs or rng.random() < 0.25):
            self._prefill()
            return
        index = rng.randrange(len(self.seqs))
        seq = self.seqs[index]
        if rng.random() < 0.03:  # preempted: dropped before it finished
            del self.seqs[index]  # by place: == on its tensors compares their elements
            return
        self._decode(seq)
        if seq["length"] >= seq["target"]:
            del self.seqs[index]

    def _prefill(self) -> None:
        prompt = self.rng.randint(16, 256)
        buf = self.call(
            "kv.prefill",
            self.client.zeros,
            prompt,
            self.width,
            dtype=dtypes.float16,
            device=self.device,
        )
        if buf is not None:
            mode = self.rng.choice(("cat", "paged"))
            target = prompt + self.rng.randint(16, 1792)
            self.seqs.append({"buf": buf, "length": prompt, "target": target, "mode": mode})

    def _decode(self, seq: dict[str, Any]) -> None:
        n = self.rng.randint(1, 16)
        new = self.call(
            "kv.new_tokens",
            self.client.full,
            (n, self.width),
            1.0,
            dtype=dtypes.float16,
            device=self.device,
        )
        if new is None:
            return
        length = seq["length"]
        if seq["mode"] == "cat":
            grown = self.call("kv.cat", self.client.cat, [seq["buf"], new], dim=0)
            if grown is None:
                return
            seq["buf"] = grown
        else:
            buf = seq["buf"]
            if length + n > buf.shape[0]:
                capacity = max(2 * buf.shape[0], length + n)
                bigger = self.call(
                    "kv.grow",
                    self.client.empty,
                    capacity,
                    self.width,
                    dtype=dtypes.float16,
                    device=self.device,
                )
                if bigger is None:
                    return
                dst = self.call("kv.narrow", bigger.narrow, 0, 0, length)
                self.call("kv.copy", dst.copy_, self.call("kv.narrow", buf.narrow, 0, 0, length))
                seq["buf"] = buf = bigger
            dst = self.call("kv.narrow", buf.narrow, 0, length, n)
            self.call("kv.copy", dst.copy_, new)
        seq["length"] = length + n

    def stop(self) -> None:
        self.seqs = []


class TrainingStep(Workload):
    """Training with a batch size that changes every step.

    Activations are allocated layer by layer going forward and freed in
    reverse going backward, each replaced by a gradient of its size; the
    weights live for the whole session.
    """

    name = "train"
    default_weight = 2
    batch_sizes = (2, 4, 6, 8, 12, 16, 24, 32)
    layer_bytes = (
        48 * KiB,
        96 * KiB,
        96 * KiB,
        64 * KiB,
        32 * KiB,
        16 * KiB,
        4 * KiB,
    )  # per sample

    def start(self) -> None:
        self.weights = self.call(
            "train.weights", self.client.zeros, self.size(2 * MiB) // 4, device=self.device
        )
        self.steps = 0

    def step(self) -> None:
        batch = self.rng.choice(self.batch_sizes)
        activations = []
        for per_sample in self.layer_bytes:
            features = max(1, self.size(per_sample) // 4)  # float32 per sample
            act = self.call("train.forward", self.client.empty, batch, features, device=self.device)
            if act is None:  # out of memory: abandon the step as a trainer would
                return
            activations.append(act)
        grad = None
        while activations:
            act = activations.pop()
            grad = self.call("train.backward", self.client.empty_like, act)
            del act
            if grad is None:
                return
        del grad
        self.steps += 1
        if self.weights is not None:
            head = self.call("train.optimizer", self.weights.narrow, 0, 0, 256)
            self.call("train.optimizer", head.fill_, float(self.steps))

    def stop(self) -> None:
        self.weights = None


class SmallChurn(Workload):
    """Many tensors under 1 MiB with random lifetimes, freed in random order."""

    name = "churn"
    default_weight = 3
    max_live = 256

    def start(self) -> None:
        self.live: list[tuple[int, Any]] = []
        self.clock = 0

    def step(self) -> None:
        self.clock += 1
        rng = self.rng
        for _ in range(rng.randint(1, 8)):
            nbytes = min(self.size(2 ** rng.uniform(9, 20)), MiB)  # log-uniform 512 B .. 1 MiB
            t = self.call(
                "churn.alloc", self.client.empty, nbytes, dtype=dtypes.uint8, device=self.device
            )
            if t is None:
                continue
            if rng.random() < 0.2:
                self.call("churn.fill", t.fill_, rng.randint(0, 255))
            self.live.append((self.clock + 1 + int(rng.expovariate(1 / 10)), t))
        rng.shuffle(self.live)
        self.live = [(due, t) for due, t in self.live if due > self.clock][-self.max_live :]

    def stop(self) -> None:
        self.live = []


class Bimodal(Workload):
    """Large short-lived and small long-lived requests interleaved.

    Small blocks that outlive the large ones between them pin segments, so
    freed large blocks cannot be reused for the next, differently sized, large
    request: the pattern that strands free memory.
    """

    name = "bimodal"
    default_weight = 1
    max_small = 48
    max_large = 2

    def start(self) -> None:
        self.small: list[tuple[int, Any]] = []
        self.large: list[tuple[int, Any]] = []
        self.clock = 0

    def step(self) -> None:
        self.clock += 1
        rng = self.rng
        if rng.random() < 0.25:
            nbytes = self.size(rng.uniform(8, 48) * MiB)
            t = self.call(
                "bimodal.large", self.client.empty, nbytes, dtype=dtypes.uint8, device=self.device
            )
            if t is not None:
                self.large.append((self.clock + rng.randint(1, 4), t))
        else:
            nbytes = self.size(rng.uniform(64 * KiB, 3 * MiB))
            t = self.call(
                "bimodal.small", self.client.empty, nbytes, dtype=dtypes.uint8, device=self.device
            )
            if t is not None:
                self.small.append((self.clock + rng.randint(20, 200), t))
        self.large = [(d, t) for d, t in self.large if d > self.clock][-self.max_large :]
        self.small = [(d, t) for d, t in self.small if d > self.clock][-self.max_small :]

    def stop(self) -> None:
        self.small, self.large = [], []


#: a view chain: (op name, on the tensord tensor, on the NumPy mirror)
ViewOp = tuple[str, Callable[[Any], Any], Callable[[np.ndarray], np.ndarray]]


class ViewHeavy(Workload):
    """Chains of views ending in ``contiguous()`` or ``clone()``; some read back and checked.

    The base tensor is an ``arange``, mirrored in NumPy, so a result read back
    can be compared with the same chain applied to the mirror.
    """

    name = "views"
    default_weight = 2
    rows, cols = 256, 512
    verify_probability = 0.1

    def start(self) -> None:
        r, c = self.rows, self.cols
        flat = self.call(
            "views.arange", self.client.arange, r * c, dtype=dtypes.float32, device=self.device
        )
        self.base = self.call("views.view", flat.view, r, c)
        self.mirror = np.arange(r * c, dtype=np.float32).reshape(r, c)

    def chain(self) -> list[ViewOp]:
        rng, r, c = self.rng, self.rows, self.cols
        a, n = rng.randrange(c - 8), rng.randint(1, 8)
        i, j = rng.randrange(r), rng.randrange(4)
        k = rng.randrange(1, r // 2)
        chains: list[list[ViewOp]] = [
            [
                ("t", lambda x: x.t(), lambda m: m.T),
                ("narrow", lambda x: x.narrow(0, a, n), lambda m: m[a : a + n]),
                ("unsqueeze", lambda x: x.unsqueeze(0), lambda m: m[None]),
            ],
            [
                ("view", lambda x: x.view(r // 2, 2, c), lambda m: m.reshape(r // 2, 2, c)),
                ("permute", lambda x: x.permute(2, 0, 1), lambda m: m.transpose(2, 0, 1)),
                ("index", lambda x: x[:, k:, 1], lambda m: m[:, k:, 1]),
            ],
            [
                ("select", lambda x: x.select(0, i), lambda m: m[i]),
                ("unsqueeze", lambda x: x.unsqueeze(0), lambda m: m[None]),
                ("expand", lambda x: x.expand(4, c), lambda m: np.broadcast_to(m, (4, c))),
            ],
            [
                ("chunk", lambda x: x.chunk(4, dim=1)[j], lambda m: np.split(m, 4, axis=1)[j]),
                ("transpose", lambda x: x.transpose(0, 1), lambda m: m.T),
                ("index", lambda x: x[::3, k:], lambda m: m[::3, k:]),
            ],
            [
                ("index", lambda x: x[k:, ::2], lambda m: m[k:, ::2]),
                ("split", lambda x: x.split(8, dim=0)[0], lambda m: m[:8]),
                ("t", lambda x: x.t(), lambda m: m.T),
            ],
        ]
        return rng.choice(chains)

    def step(self) -> None:
        if self.base is None:
            return
        chain = self.chain()
        cur, ref = self.base, self.mirror
        for op, on_tensor, on_mirror in chain:
            cur = self.call(f"views.{op}", on_tensor, cur)
            ref = on_mirror(ref)
        finish = self.rng.choice(("contiguous", "clone"))
        out = self.call(f"views.{finish}", getattr(cur, finish))
        if out is None or self.rng.random() >= self.verify_probability:
            return
        # force: a GPU tensor copies to the host, as torch numpy(force=True); plain numpy()
        # refuses a tensor off the CPU (TypeError, as torch)
        got = self.call("views.numpy", out.numpy, force=True)
        ok = got.shape == ref.shape and bool(np.array_equal(got, ref))
        self.verify("views.verify", ok, f"chain {[op for op, _, _ in chain]} read back wrong data")

    def stop(self) -> None:
        self.base = None


#: tokens handed between users of one process (cross-process sharing goes by name)
_TOKENS: deque[str] = deque(maxlen=64)


class Sharing(Workload):
    """Users pass tensors to each other by name (``put``/``get``) and by token (``share``/``attach``).

    Every tensor is filled with one value, so a reader checks that what it
    got is whole.  A name may be deleted or overwritten by its owner between
    ``names()`` and ``get()``: that NOT_FOUND is expected.  Each user deletes its
    own names when it stops.
    """

    name = "sharing"
    default_weight = 1
    slots = 4

    def start(self) -> None:
        self.prefix = f"loadtest/{self.run_id}/"
        self.own: set[str] = set()
        self.held: list[Any] = []  # what this user attached, kept a few steps
        # A share token pins its Storage until attached (single use) or expired, so tokens
        # are only ever issued for this one tensor: sharing costs no memory as the run goes on.
        self.published = self._make("share.make")

    def _make(self, op: str) -> Any:
        n = self.size(self.rng.randint(1, 64) * 4 * KiB) // 4 or 1
        return self.call(
            op, self.client.full, (n,), float(self.rng.randint(1, 1000)), device=self.device
        )

    def _check(self, op: str, t: Any) -> None:
        head = self.call(f"{op}.numpy", t.numpy, force=True) if t.shape[0] <= 4096 else None
        if head is None:
            head = self.call(f"{op}.numpy", t.narrow(0, 0, 4096).numpy, force=True)
        self.verify(f"{op}.verify", bool((head == head[0]).all()), f"{op}: mixed values")

    def step(self) -> None:
        action = self.rng.choice(("put", "get", "get", "share", "attach", "delete"))
        client = self.client
        if action == "put":
            name = f"{self.prefix}{self.user_id}/{self.rng.randrange(self.slots)}"
            t = self._make("share.make")
            if t is not None:
                self.own.add(name)  # before the call: a put cut short may still land
                self.call("share.put", client.put, name, t, overwrite=True)
        elif action == "get":
            names = self.call("share.names", client.names)
            mine = f"{self.prefix}{self.user_id}/"
            theirs = [n for n in names if n.startswith(self.prefix) and not n.startswith(mine)]
            if theirs:
                t = self.call(
                    "share.get", client.get, self.rng.choice(theirs), expect=(NotFoundError,)
                )
                if t is not None:
                    self._check("share.get", t)
                    self.held.append(t)
        elif action == "share":
            if self.published is not None:
                _TOKENS.append(self.call("share.token", self.published.share))
        elif action == "attach":
            if _TOKENS:
                t = self.call(
                    "share.attach", client.attach, _TOKENS.popleft(), expect=(NotFoundError,)
                )
                if t is not None:
                    self._check("share.attach", t)
                    self.held.append(t)
        elif self.own:
            name = self.rng.choice(sorted(self.own))
            self.call("share.delete", client.delete, name, expect=(NotFoundError,))
            self.own.discard(name)
        self.held = self.held[-8:]

    def stop(self) -> None:
        self.held, self.published = [], None
        for name in sorted(self.own):
            self.call("share.delete", self.client.delete, name, expect=(NotFoundError,))
        self.own.clear()


#: share tokens the ``cross`` users made, with the node each was made on, handed between
#: users of one process (a Locust process runs users of every node, round robin)
_NODE_TOKENS: deque[tuple[str, str]] = deque(maxlen=64)


class CrossNode(Workload):
    """Cluster only: tensors handed from node to node, every step one of each.

    ``put`` names a tensor on the user's own node; ``get`` reads a ``cross`` name (another
    user's or its own) through a client of a node that does not hold it (the user's own
    client for another node's name, its session on another node for its own name), so the
    node asked redirects to the holder; ``to`` copies a tensor to another node
    (``x.to("b/cpu")``); ``share`` makes a token on the user's node, and ``attach`` attaches
    the oldest token waiting (made by any ``cross`` user of this process) from a node it was
    not made on.  Each of ``get``, ``to`` and ``attach`` is checked (``.verify``): the handle
    lives on the node that holds the bytes, not the one asked, and the bytes read back are
    what was written (every tensor is filled with one value).  Against a single server
    (``nodes()`` refused: an expected error), or a cluster of one node, the workload does
    nothing more: ``tensord loadtest`` runs it against a cluster only (weight
    ``cluster_weight`` in a cluster run's default mix).
    """

    name = "cross"
    default_weight = 0  # off against a single server
    needs_cluster = True
    cluster_weight = 2  # its weight in a cluster run's default mix
    slots = 2

    def start(self) -> None:
        self.prefix = f"loadtest/{self.run_id}/cross/"
        self.own: set[str] = set()
        self.held: list[Any] = []  # what this user got, copied or attached, kept a few steps
        self.turn = 0
        listed = self.call("cross.nodes", self.client.nodes, expect=(FailedPreconditionError,))
        self.node_id: str = next((n["node"] for n in listed or () if n["self"]), "")
        self.others: list[str] = [n["node"] for n in listed or () if not n["self"]]
        # where this user's sessions on the nodes are (a redirect or a copy opens them there)
        self.registered: dict[str, str] = {n["node"]: n["address"] for n in listed or ()}
        self.published = self._make() if self.others else None

    def _make(self) -> tuple[Any, float] | None:
        n = self.size(self.rng.randint(1, 16) * 4 * KiB) // 4 or 1
        value = float(self.rng.randint(1, 1000))
        t = self.call("cross.make", self.client.full, (n,), value, device=self.device)
        return None if t is None else (t, value)

    def _other(self) -> str:
        """Another node, round robin over them step by step."""
        return self.others[self.turn % len(self.others)]

    def _asker(self, holder: str) -> Any:
        """A client of a node other than ``holder``: the user's own client, or for its own
        node's bytes its session on another node."""
        if holder != self.node_id:
            return self.client
        return self.call("cross.node", self.client.node, self._other())

    def _check(self, op: str, t: Any, holder: str, asker: Any, value: float | None) -> None:
        """The handle lives on ``holder`` (in a session there, at the address it registered),
        not on the node ``asker`` asked, and holds one value (``value``, when known)."""
        got = self.call(f"{op}.numpy", t.numpy, force=True)
        whole = bool((got == got[0]).all()) and (value is None or bool(got[0] == value))
        placed = t.client is not asker and t.client.address == self.registered[holder]
        self.verify(
            f"{op}.verify",
            whole and placed,
            f"{op} of {holder}'s bytes: "
            + ("the handle is not on the holder" if whole else "wrong values"),
        )
        self.held.append(t)

    def step(self) -> None:
        if not self.others:
            return
        self.turn += 1
        self._put()
        self._get()
        self._to()
        self._share_and_attach()
        self.held = self.held[-8:]

    def _put(self) -> None:
        made = self._make()
        if made is None:
            return
        name = f"{self.prefix}{self.node_id}/{self.user_id}/{self.rng.randrange(self.slots)}"
        self.own.add(name)  # before the call: a put cut short may still land
        self.call("cross.put", self.client.put, name, made[0], overwrite=True)

    def _get(self) -> None:
        names = self.call("cross.names", self.client.names)
        # a cross name says its node: loadtest/<run>/cross/<node>/<user>/<slot>; one of a
        # node that joined after this user started is left alone (its address is unknown)
        ours = [
            (n, n[len(self.prefix) :].split("/", 1)[0]) for n in names if n.startswith(self.prefix)
        ]
        known = [(n, holder) for n, holder in ours if holder in self.registered]
        if not known:
            return
        name, holder = self.rng.choice(known)
        asker = self._asker(holder)
        if asker is None:
            return
        t = self.call("cross.get", asker.get, name, expect=(NotFoundError,))
        if t is not None:
            self._check("cross.get", t, holder, asker, None)

    def _to(self) -> None:
        if self.published is None:
            return
        source, value = self.published
        target = self._other()
        y = self.call("cross.to", source.to, f"{target}/{self.device}")
        if y is not None:
            self._check("cross.to", y, target, self.client, value)

    def _share_and_attach(self) -> None:
        if self.published is not None:
            token = self.call("cross.share", self.published[0].share)
            if token is not None:
                _NODE_TOKENS.append((self.node_id, token))  # it ends with this session
        if not _NODE_TOKENS:
            return
        holder, token = _NODE_TOKENS.popleft()
        if holder not in self.registered:  # a node that joined after this user started
            return
        asker = self._asker(holder)
        if asker is None:
            return
        t = self.call("cross.attach", asker.attach, token, expect=(NotFoundError,))
        if t is not None:
            self._check("cross.attach", t, holder, asker, None)

    def stop(self) -> None:
        self.held, self.published = [], None
        for name in sorted(self.own):
            self.call("cross.delete", self.client.delete, name, expect=(NotFoundError,))
        self.own.clear()


#: (is_alloc, block id, bytes) for each alloc / free_completed of a trace
TraceOps = list[tuple[bool, int, int]]
_TRACE_CACHE: dict[tuple[str, int], TraceOps] = {}


def load_trace(path: str | os.PathLike[str], divisor: int) -> TraceOps:
    """The allocs and completed frees of a ``[action, addr, size, stream]`` trace, sizes divided.

    ``path`` is a file or the name of a bundled trace (``resnet50_train``).
    ``addr`` names a block from its alloc to its free; it becomes a dense id.
    Cached per process: every replaying user shares one copy.
    """
    key = (str(path), divisor)
    if key not in _TRACE_CACHE:
        with gzip.open(resolve_trace(Path(path)), "rt") as f:
            events: Sequence[Sequence[Any]] = json.load(f)
        _TRACE_CACHE[key] = scale_trace(events, divisor)
    return _TRACE_CACHE[key]


def scale_trace(events: Iterable[Sequence[Any]], divisor: int) -> TraceOps:
    ops: TraceOps = []
    live: dict[int, int] = {}  # addr -> block id
    next_id = 0
    for action, addr, size, _stream in events:
        if action == "alloc":
            live[addr] = next_id
            ops.append((True, next_id, max(1, int(size) // divisor)))
            next_id += 1
        elif action == "free_completed" and addr in live:
            ops.append((False, live.pop(addr), 0))
    return ops


class TraceReplay(Workload):
    """Replays a PyTorch allocator trace (default: the bundled ResNet-50 one), sizes divided to fit.

    Each step plays the next ``events_per_step`` events; at the end of the
    trace everything still live is dropped and the replay starts over (a loop).
    """

    name = "trace"
    default_weight = 1
    events_per_step = 32

    def __init__(self, *args: Any, trace: str | None = None, divisor: int = 256, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.trace_path = trace or os.environ.get("TENSORD_TRACE") or str(DEFAULT_TRACE)
        self.divisor = max(1, int(divisor / self.scale))

    def start(self) -> None:
        self.position = 0
        self.live: dict[int, Any] = {}
        self.loops = 0
        self.ops: TraceOps = []  # a missing trace fails here, recorded, and the user idles
        self.ops = self.call("trace.load", load_trace, self.trace_path, self.divisor)

    def step(self) -> None:
        if not self.ops:
            return
        end = min(self.position + self.events_per_step, len(self.ops))
        for is_alloc, block, nbytes in self.ops[self.position : end]:
            self.position += 1
            if is_alloc:
                t = self.call(
                    "trace.alloc", self.client.empty, nbytes, dtype=dtypes.uint8, device=self.device
                )
                if t is not None:
                    self.live[block] = t
            else:
                self.live.pop(block, None)
        if self.position >= len(self.ops):
            self.live.clear()
            self.position = 0
            self.loops += 1

    def stop(self) -> None:
        self.live = {}


WORKLOADS: dict[str, type[Workload]] = {
    w.name: w
    for w in (
        KVCache,
        TrainingStep,
        SmallChurn,
        Bimodal,
        ViewHeavy,
        Sharing,
        TraceReplay,
        CrossNode,
    )
}


def workload_rng(
    seed: str | None, workload: str, number: int, worker: int = 0, step: int | None = None
) -> random.Random:
    """The random source of the ``number``-th user (from 0, in start order) of ``workload``
    in Locust worker ``worker``, for its ``step``-th step (None: its start()): unseeded
    without a ``seed`` (``tensord loadtest --seed``); with one, the same sequence for the
    same (seed, worker, workload, number, step), so two runs with one seed make the same
    choices (sizes, which KV sequences grow by ``cat`` and which by ``narrow().copy_()``,
    lengths, ...) user by user and step by step.  A generator per step: a call that fails
    in one run and not in the other (an OOM under one policy) changes what that step draws
    after it, not every later step.  Paired runs compare policies on the same work that
    way: unseeded, the share of cheap client-side ops alone moved a 30-second run's
    requests/s by several percent (``kv.copy`` + ``kv.narrow`` 3,116 in one run, 1,606 in
    the next)."""
    if seed is None:
        return random.Random()
    key = f"{seed}/{worker}/{workload}/{number}"
    return random.Random(key if step is None else f"{key}/{step}")


def seeded_step(workload: Workload, seed: str | None, number: int, worker: int, step: int) -> None:
    """``workload.step()``, the ``step``-th of the ``number``-th user, from its own seeded
    generator (:func:`workload_rng`) when there is a ``seed``."""
    if seed is not None:
        workload.rng = workload_rng(seed, workload.name, number, worker, step)
    workload.step()


def parse_weights(spec: str | None, *, cluster: bool = False) -> dict[str, int]:
    """``"kv=3,train=2"`` (or ``"kv,train"``, weight 1) -> weights; empty: every default
    (with ``cluster``, the ``cross`` users' too: :attr:`CrossNode.cluster_weight`).

    Workloads not named get weight 0.  Raises ValueError naming an unknown workload.
    """
    if not spec:
        weights = {name: w.default_weight for name, w in WORKLOADS.items()}
        if cluster:
            weights[CrossNode.name] = CrossNode.cluster_weight
        return weights
    weights = dict.fromkeys(WORKLOADS, 0)
    for item in spec.split(","):
        name, _, weight = item.strip().partition("=")
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
        default = (
            CrossNode.cluster_weight if name == CrossNode.name else WORKLOADS[name].default_weight
        )
        weights[name] = int(weight) if weight else default
    return weights


def user_address(addresses: Sequence[str], workload: str, number: int, worker: int = 0,
                 workers: int = 1) -> str:  # fmt: skip
    """The address the ``number``-th user (from 0, in start order) of ``workload`` in Locust
    worker ``worker`` (of ``workers``) connects to: round robin over ``addresses``, so each
    workload's users spread evenly over the nodes; each workload starts at its own place in
    :data:`WORKLOADS`, so the first users of the workloads go to different nodes too."""
    if not addresses:
        raise ValueError("no address to connect to")
    offset = list(WORKLOADS).index(workload) if workload in WORKLOADS else 0
    index = offset + number * max(1, workers) + worker
    return addresses[index % len(addresses)]


def connect_op(address: str) -> str:
    """The op a user's connect is recorded as in a cluster run: one row per node's address,
    so the report tells how many users each node got."""
    return f"session.connect {address}"
