"""Differential property test: tensord.layout against torch 2.13 (CPU) as the oracle.

Each case builds a random strided tensor (the same ``as_strided`` on a real
torch storage and on a Layout), then applies a random chain of view ops with
random — often invalid — arguments to both.  After every step the two must
agree on shape, stride, storage offset, is_contiguous and
is_non_overlapping_and_dense, or raise the same exception type with the same
message.  Only metadata is compared; the storage is never read.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from tensord import dtypes  # noqa: E402
from tensord.layout import Layout  # noqa: E402
from torch._prims_common import is_non_overlapping_and_dense_or_false  # noqa: E402

pytestmark = pytest.mark.torch

# Cases (hypothesis examples) and op applications run, per test: the closing test checks them.
CASES: dict[str, int] = {}
STEPS = {"ops": 0, "errors": 0}

# dtypes a chain may view(dtype) into: every element size torch has
VIEW_DTYPES = (dtypes.int8, dtypes.int16, dtypes.float32, dtypes.float64, dtypes.complex128)
STORAGE_ALIGN = 4  # storage length in float32s, a multiple of 4 so nbytes % 16 == 0

MAX_CHAIN = 6
BASE_SETTINGS = settings(
    derandomize=True,  # reproducible in CI
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _message(exc: BaseException) -> str:
    # torch appends a C++ traceback to some wrapped errors; compare the text before it
    return str(exc).split("\nException raised from")[0]


class State:
    """A torch tensor and the Layout that should describe it."""

    def __init__(self, tensor: Any, layout: Layout, dtype: dtypes.DType) -> None:
        self.tensor = tensor
        self.layout = layout
        self.dtype = dtype

    @property
    def storage_elements(self) -> int:
        return int(self.tensor.untyped_storage().nbytes()) // self.dtype.itemsize


def check_same(tensor: Any, layout: Layout, what: str) -> None:
    assert tuple(tensor.shape) == layout.shape, what
    assert tuple(tensor.stride()) == layout.stride, what
    assert tensor.storage_offset() == layout.offset, what
    assert tensor.is_contiguous() == layout.is_contiguous(), what
    # c10's is_non_overlapping_and_dense (what eager torch, empty_like and clone use) has no
    # Python binding; empty_like(t) keeps t's strides exactly when it holds, else it makes new
    # (dense) ones.  torch._prims_common's version disagrees with c10 on some size-1/stride-0
    # dims (its sort key K is not a strict order), so it is the oracle only where it is stable.
    like = torch.empty_like(tensor)
    noad = tuple(like.stride()) == tuple(tensor.stride())
    assert noad == layout.is_non_overlapping_and_dense(), what
    if not any(n == 1 and st == 0 for n, st in zip(layout.shape, layout.stride, strict=True)):
        assert is_non_overlapping_and_dense_or_false(tensor) == noad, what
    dense = layout.dense_like()
    assert (tuple(like.stride()), like.storage_offset()) == (dense.stride, dense.offset), what


def run_both(
    state: State,
    torch_op: Callable[[Any], Any],
    ours: Callable[[Layout], Any],
    what: str,
) -> Any:
    """Apply one op to both sides.  Returns (torch_result, our_result) or None on a matching raise."""
    STEPS["ops"] += 1
    t_exc: BaseException | None = None
    o_exc: BaseException | None = None
    try:
        t_res = torch_op(state.tensor)
    except (RuntimeError, IndexError, ValueError, TypeError) as e:
        t_exc = e
    try:
        o_res = ours(state.layout)
    except (RuntimeError, IndexError, ValueError, TypeError) as e:
        o_exc = e
    if t_exc is not None or o_exc is not None:
        assert t_exc is not None, (
            f"{what}: torch succeeded, tensord raised {o_exc!r} on {state.layout}"
        )
        assert o_exc is not None, (
            f"{what}: torch raised {t_exc!r}, tensord gave {o_res} on {state.layout}"
        )
        assert type(o_exc).__name__ == type(t_exc).__name__, f"{what}: {t_exc!r} vs {o_exc!r}"
        assert _message(o_exc) == _message(t_exc), f"{what} on {state.layout}"
        STEPS["errors"] += 1
        return None
    return t_res, o_res


# -- strategies -----------------------------------------------------------------------------

SIZES = (0, 1, 1, 2, 2, 3, 3, 4, 5)  # small, with size-0 and size-1 dims often


def make_state(layout: Layout, slack: int) -> State:
    """The same strided tensor on a real torch storage (slack spare elements after its extent)."""
    n = layout.storage_extent() + slack + 1
    n += -n % STORAGE_ALIGN
    tensor = torch.empty(n).as_strided(layout.shape, layout.stride, layout.offset)
    return State(tensor, layout, dtypes.float32)


def random_start(rng: random.Random) -> State:
    """A random starting layout: a permuted contiguous one, or arbitrary (overlapping) strides."""
    ndim = rng.randint(0, 4)
    shape = tuple(rng.choice(SIZES) for _ in range(ndim))
    if rng.random() < 0.5:
        base = Layout.contiguous(shape)
        perm = rng.sample(range(ndim), ndim)
        stride = tuple(base.stride[p] for p in perm)
        shape = tuple(shape[p] for p in perm)
    else:
        stride = tuple(rng.randint(0, 12) for _ in range(ndim))
    return make_state(Layout(shape, stride, rng.randint(0, 5)), rng.randint(0, 6))


@st.composite
def start_states(draw: st.DrawFn) -> State:
    """The same as random_start, drawn by hypothesis (so it shrinks to a small layout)."""
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.sampled_from(SIZES)) for _ in range(ndim))
    if draw(st.booleans()):
        base = Layout.contiguous(shape)
        perm = draw(st.permutations(range(ndim)))
        layout = Layout(
            tuple(shape[p] for p in perm),
            tuple(base.stride[p] for p in perm),
            draw(st.integers(0, 5)),
        )
    else:
        stride = tuple(draw(st.integers(0, 12)) for _ in range(ndim))
        layout = Layout(shape, stride, draw(st.integers(0, 5)))
    return make_state(layout, draw(st.integers(0, 6)))


def dim_arg(rng: random.Random, ndim: int) -> int:
    # mostly valid, sometimes one or two out of range on either side
    return rng.randint(-max(ndim, 1) - 2, max(ndim, 1) + 1)


def shape_arg(rng: random.Random, numel: int) -> list[int]:
    """A target shape: usually a factorisation of numel (maybe with a -1), sometimes random."""
    if rng.randint(0, 2) == 0:
        return [rng.randint(-2, 6) for _ in range(rng.randint(0, 4))]
    parts: list[int] = []
    left = numel
    for _ in range(rng.randint(0, 4)):
        divisors = [d for d in range(1, 7) if left % d == 0] if left else [0, 1, 2]
        d = rng.choice(divisors)
        parts.append(d)
        left = left // d if d else left
    if left != 1 or rng.random() < 0.5:
        parts.append(left)
    rng.shuffle(parts)
    if parts and rng.randint(0, 3) == 0:
        parts[rng.randint(0, len(parts) - 1)] = -1
    return parts


def index_item(rng: random.Random) -> Any:
    def bound() -> int | None:
        return None if rng.random() < 0.3 else rng.randint(-7, 7)

    kind = rng.randint(0, 9)
    if kind <= 2:
        return rng.randint(-5, 5)
    if kind <= 5:
        return slice(bound(), bound(), rng.choice([None, 1, 1, 2, 3]))
    if kind == 6:
        return slice(bound(), bound(), rng.choice([0, -1]))
    return None if kind <= 8 else Ellipsis


def expand_arg(rng: random.Random, shape: tuple[int, ...]) -> list[int]:
    out = []
    for s in shape:
        choice = rng.randint(0, 3)
        out.append([s, -1, rng.randint(0, 4), 1][choice] if s == 1 else [s, -1, s, 3][choice])
    lead = [rng.choice([1, 2, 3, 0, -1]) for _ in range(rng.randint(0, 2))]
    result = lead + out
    if rng.randint(0, 4) == 0 and result:
        result = result[1:]  # too few sizes
    if not shape and 0 in result:
        # torch lets a 0-dim tensor expand to e.g. [0, -1] (a tensor with a negative size);
        # tensord refuses negative sizes, so that corner is left out
        result = [1 if r == -1 else r for r in result]
    return result


OPS = (
    "view", "reshape", "view_dtype", "narrow", "select", "getitem", "transpose", "t",
    "permute", "movedim", "expand", "squeeze", "unsqueeze", "flatten", "unflatten",
    "split", "chunk", "unbind", "diagonal", "as_strided",
    # torch's wider view surface
    "tensor_split", "hvdsplit", "unfold", "ravel", "broadcast_to", "matrix",
)  # fmt: skip

Op = tuple[str, Callable[[Any], Any], Callable[[Layout], Any], str]


def _quietly(op: Callable[[], Any]) -> Any:
    # torch warns (once) that x.mT and friends of a 0-dim tensor are deprecated
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return op()


def draw_op(rng: random.Random, state: State) -> Op:
    """One op with random (often invalid) arguments, for torch and for Layout.

    The kind says what it returns: "view" (one result), "maybe" (Layout | None, None
    meaning torch copied), "many" (a tuple), "dtype:<name>" (a view as another dtype).
    """
    lay = state.layout
    nd = lay.ndim
    name = rng.choice(OPS)
    if name == "view":
        shape = shape_arg(rng, lay.numel)
        return f"view({shape})", lambda t: t.view(shape), lambda x: x.view(shape), "view"
    if name == "reshape":
        shape = shape_arg(rng, lay.numel)
        return f"reshape({shape})", lambda t: t.reshape(shape), lambda x: x.reshape(shape), "maybe"
    if name == "view_dtype":
        new = rng.choice(VIEW_DTYPES)
        old = state.dtype
        return (
            f"view({new})",
            lambda t: t.view(dtypes.to_torch(new)),
            lambda x: x.view_dtype(
                old.itemsize, new.itemsize, old_name=old.scalar_type, new_name=new.scalar_type
            ),
            "dtype:" + new.name,
        )
    if name == "narrow":
        d, s, n = dim_arg(rng, nd), rng.randint(-6, 6), rng.randint(-1, 5)
        return (
            f"narrow({d}, {s}, {n})",
            lambda t: t.narrow(d, s, n),
            lambda x: x.narrow(d, s, n),
            "view",
        )
    if name == "select":
        d, i = dim_arg(rng, nd), rng.randint(-6, 6)
        return f"select({d}, {i})", lambda t: t.select(d, i), lambda x: x.select(d, i), "view"
    if name == "getitem":
        if rng.randint(0, 3) == 0:
            idx: Any = index_item(rng)
        else:
            idx = tuple(index_item(rng) for _ in range(rng.randint(0, nd + 1)))
            if idx.count(Ellipsis) > 1 and any(isinstance(i, (int, slice)) for i in idx):
                # torch then reads sizes past the tensor's dims (undefined behaviour in
                # applySelect / applySlice); keep one Ellipsis so the oracle is well defined
                first = idx.index(Ellipsis)
                idx = tuple(
                    i if i is not Ellipsis or k == first else None for k, i in enumerate(idx)
                )
        return f"[{idx!r}]", lambda t: t[idx], lambda x: x[idx], "view"
    if name == "transpose":
        a, b = dim_arg(rng, nd), dim_arg(rng, nd)
        return (
            f"transpose({a}, {b})",
            lambda t: t.transpose(a, b),
            lambda x: x.transpose(a, b),
            "view",
        )
    if name == "t":
        return "t()", lambda t: t.t(), lambda x: x.t(), "view"
    if name == "permute":
        if rng.randint(0, 4) == 0:
            dims = [dim_arg(rng, nd) for _ in range(rng.randint(0, nd + 1))]
        else:
            dims = [p - nd if rng.random() < 0.5 else p for p in rng.sample(range(nd), nd)]
        return f"permute({dims})", lambda t: t.permute(dims), lambda x: x.permute(dims), "view"
    if name == "movedim":
        k = rng.randint(0, min(nd, 3))
        if k == 1 and rng.random() < 0.5:
            src: Any = dim_arg(rng, nd)
            dst: Any = dim_arg(rng, nd)
        else:
            src = [dim_arg(rng, nd) for _ in range(k)]
            dst = [dim_arg(rng, nd) for _ in range(k + int(rng.randint(0, 5) == 0))]
        return (
            f"movedim({src}, {dst})",
            lambda t: t.movedim(src, dst),
            lambda x: x.movedim(src, dst),
            "view",
        )
    if name == "expand":
        sizes_ = expand_arg(rng, lay.shape)
        type_name = dtypes.tensor_type_name(state.dtype)
        return (
            f"expand({sizes_})",
            lambda t: t.expand(sizes_),
            lambda x: x.expand(sizes_, type_name=type_name),
            "view",
        )
    if name == "squeeze":
        choice = rng.randint(0, 2)
        if choice == 0:
            return "squeeze()", lambda t: t.squeeze(), lambda x: x.squeeze(), "view"
        if choice == 1:
            d = dim_arg(rng, nd)
            return f"squeeze({d})", lambda t: t.squeeze(d), lambda x: x.squeeze(d), "view"
        ds = tuple(dim_arg(rng, nd) for _ in range(rng.randint(0, 3)))
        return f"squeeze({ds})", lambda t: t.squeeze(ds), lambda x: x.squeeze(ds), "view"
    if name == "unsqueeze":
        d = dim_arg(rng, nd + 1)
        return f"unsqueeze({d})", lambda t: t.unsqueeze(d), lambda x: x.unsqueeze(d), "view"
    if name == "flatten":
        a, b = (0, -1) if rng.random() < 0.5 else (dim_arg(rng, nd), dim_arg(rng, nd))
        return f"flatten({a}, {b})", lambda t: t.flatten(a, b), lambda x: x.flatten(a, b), "maybe"
    if name == "unflatten":
        d = dim_arg(rng, nd)
        n = lay.shape[d] if -nd <= d < nd else 4
        opts = [[n], [1, n], [n, 1], [-1, 1], [2, -1], [-1, -1], [], [2, 2], [n, -2]]
        if n:
            opts += [[d_, n // d_] for d_ in range(1, n + 1) if n % d_ == 0]
        us = rng.choice(opts)
        return (
            f"unflatten({d}, {us})",
            lambda t: t.unflatten(d, us),
            lambda x: x.unflatten(d, us),
            "view",
        )
    if name == "split":
        d = dim_arg(rng, nd)
        if rng.random() < 0.5:
            ss: Any = rng.randint(-1, 5)
        else:
            ss = [rng.randint(-1, 4) for _ in range(rng.randint(0, 4))]
        return f"split({ss}, {d})", lambda t: t.split(ss, d), lambda x: x.split(ss, d), "many"
    if name == "chunk":
        d, c = dim_arg(rng, nd), rng.randint(-1, 6)
        return f"chunk({c}, {d})", lambda t: t.chunk(c, d), lambda x: x.chunk(c, d), "many"
    if name == "unbind":
        d = dim_arg(rng, nd)
        return f"unbind({d})", lambda t: t.unbind(d), lambda x: x.unbind(d), "many"
    if name == "diagonal":
        o = rng.randint(-4, 4)
        a, b = (0, 1) if rng.random() < 0.5 else (dim_arg(rng, nd), dim_arg(rng, nd))
        return (
            f"diagonal({o}, {a}, {b})",
            lambda t: t.diagonal(o, a, b),
            lambda x: x.diagonal(o, a, b),
            "view",
        )
    if name == "tensor_split":
        d = dim_arg(rng, nd)
        if rng.random() < 0.5:
            ts: Any = rng.randint(-1, 6)
        else:
            ts = [rng.randint(-6, 7) for _ in range(rng.randint(0, 4))]
        return (
            f"tensor_split({ts}, {d})",
            lambda t: t.tensor_split(ts, d),
            lambda x: x.tensor_split(ts, d),
            "many",
        )
    if name == "hvdsplit":
        fn = rng.choice(("hsplit", "vsplit", "dsplit"))
        if rng.random() < 0.5:
            hs: Any = rng.randint(-2, 5)
        else:
            hs = [rng.randint(-4, 6) for _ in range(rng.randint(0, 3))]
        return (
            f"{fn}({hs})",
            lambda t: getattr(t, fn)(hs),
            lambda x: getattr(x, fn)(hs),
            "many",
        )
    if name == "unfold":
        d, size_, step = dim_arg(rng, nd), rng.randint(-1, 5), rng.randint(-1, 4)
        return (
            f"unfold({d}, {size_}, {step})",
            lambda t: t.unfold(d, size_, step),
            lambda x: x.unfold(d, size_, step),
            "view",
        )
    if name == "ravel":
        return "ravel()", lambda t: t.ravel(), lambda x: x.ravel(), "maybe"
    if name == "broadcast_to":
        sizes_ = expand_arg(rng, lay.shape)
        type_name = dtypes.tensor_type_name(state.dtype)
        return (
            f"broadcast_to({sizes_})",
            lambda t: t.broadcast_to(sizes_),
            lambda x: x.expand(sizes_, type_name=type_name),
            "view",
        )
    if name == "matrix":  # of a real dtype, H/mH/adjoint are transposes (complex: conj too)
        attr = "mT" if state.dtype.is_complex else rng.choice(("mT", "mH", "H", "adjoint"))
        if attr == "H":
            ours_m: Callable[[Layout], Any] = lambda x: x.h()  # noqa: E731
        else:
            label_ = "adjoint()" if attr == "adjoint" else attr
            ours_m = lambda x: x.matrix_transpose(label_)  # noqa: E731
        if attr == "adjoint":
            return "adjoint()", lambda t: _quietly(t.adjoint), ours_m, "view"
        return attr, lambda t: _quietly(lambda: getattr(t, attr)), ours_m, "view"
    assert name == "as_strided"
    k = rng.randint(0, 3)
    size = [rng.randint(0, 5) for _ in range(k)]
    stride = [rng.randint(-1, 12) for _ in range(k + int(rng.randint(0, 9) == 0))]
    off = None if rng.random() < 0.2 else rng.randint(-2, 24)
    n = state.storage_elements
    itemsize = state.dtype.itemsize
    return (
        f"as_strided({size}, {stride}, {off})",
        lambda t: t.as_strided(size, stride, off),
        lambda x: x.as_strided(size, stride, off, storage_elements=n, itemsize=itemsize),
        "view",
    )


def run_chain(rng: random.Random, state: State, length: int) -> None:
    check_same(state.tensor, state.layout, "start")
    trail = [f"start {state.layout}"]
    for _ in range(length):
        what, torch_op, ours, kind = draw_op(rng, state)
        trail.append(what)
        label = " -> ".join(trail)
        both = run_both(state, torch_op, ours, label)
        if both is None:
            continue
        t_res, o_res = both
        dtype = state.dtype
        if kind.startswith("dtype:"):
            dtype = dtypes.dtype_from_name(kind.removeprefix("dtype:"))
        if kind == "many":
            assert isinstance(o_res, tuple) and len(o_res) == len(t_res), label
            for t_part, o_part in zip(t_res, o_res, strict=True):
                check_same(t_part, o_part, label)
            if not o_res:
                return
            i = rng.randint(0, len(o_res) - 1)
            t_res, o_res = t_res[i], o_res[i]
        elif kind == "maybe":
            copied = t_res.untyped_storage().data_ptr() != state.tensor.untyped_storage().data_ptr()
            assert copied == (o_res is None), f"{label}: torch copied={copied}, tensord {o_res}"
            if o_res is None:
                return  # torch made a new storage; the chain on this storage ends
        check_same(t_res, o_res, label)
        state = State(t_res, o_res, dtype)


seeds = st.integers(0, 2**32 - 1)


@pytest.mark.slow
@settings(BASE_SETTINGS, max_examples=13000)
@given(seed=seeds)
def test_random_chains_match_torch(seed: int) -> None:
    """Chains of up to MAX_CHAIN ops from a random start, all drawn from random.Random(seed).

    One hypothesis draw per case keeps 13,000 cases fast; the failure message
    spells out the whole chain, so the seed need not shrink.
    """
    CASES["chains"] = CASES.get("chains", 0) + 1
    rng = random.Random(seed)
    run_chain(rng, random_start(rng), rng.randint(1, MAX_CHAIN))


@pytest.mark.slow
@settings(BASE_SETTINGS, max_examples=3000)
@given(state=start_states(), seed=seeds)
def test_single_ops_match_torch(state: State, seed: int) -> None:
    CASES["single"] = CASES.get("single", 0) + 1
    run_chain(random.Random(seed), state, 1)


@pytest.mark.slow
@settings(BASE_SETTINGS, max_examples=5000)
@given(state=start_states(), seed=seeds)
def test_view_and_reshape_match_torch(state: State, seed: int) -> None:
    """The computeStride rule, on its own: view / reshape to random shapes."""
    CASES["view"] = CASES.get("view", 0) + 1
    shape = shape_arg(random.Random(seed), state.layout.numel)
    run_both(state, lambda t: t.view(shape), lambda x: x.view(shape), f"view {shape}")
    both = run_both(
        state, lambda t: t.reshape(shape), lambda x: x.reshape(shape), f"reshape {shape}"
    )
    if both is not None:
        t_res, o_res = both
        copied = t_res.untyped_storage().data_ptr() != state.tensor.untyped_storage().data_ptr()
        assert copied == (o_res is None), (state.layout, shape)
        if o_res is not None:
            check_same(t_res, o_res, f"reshape {shape}")


@pytest.mark.slow  # counts the cases of the slow differential tests above
def test_case_count() -> None:
    """Runs last (file order): the differential cases above add up to at least 20,000."""
    if set(CASES) != {"chains", "single", "view"}:
        pytest.skip("only part of the differential tests ran")
    total = sum(CASES.values())
    print(
        f"\ndifferential cases: {total} ({CASES}); ops compared: {STEPS['ops']}, "
        f"of which matching raises: {STEPS['errors']}; mismatches: 0"
    )
    assert total >= 20_000, CASES
