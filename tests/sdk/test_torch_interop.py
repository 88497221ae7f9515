"""torch's code takes tensord tensors: torch's functions, nn.functional, operators and methods
compute on aliases of the pooled bytes, with torch as the oracle on the same values.

In-place ops write the pool (another process sees them), modules run on pooled weights from
two processes with one copy of the weights, and a client without the mapping refuses, or
downloads when asked to.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import tensord
from conftest import run_client_child

torch = pytest.importorskip("torch")
F = torch.nn.functional


@pytest.fixture
def policy() -> Iterator[None]:
    """Leaves the process's torch policy as it found it."""
    before = tensord.torch_policy()
    yield
    tensord.set_torch_policy(before)


def same(ours: Any, theirs: Any) -> None:
    """``ours`` is what torch gives on tensord tensors, ``theirs`` on torch's: equal in type,
    dtype, shape and values."""
    if isinstance(theirs, torch.Tensor):
        assert type(ours) is torch.Tensor, type(ours)  # an ordinary torch tensor
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, equal_nan=True, rtol=0, atol=0)
    elif isinstance(theirs, tuple):
        assert type(ours) is type(theirs) and len(ours) == len(theirs)
        for mine, other in zip(ours, theirs, strict=True):
            same(mine, other)
    else:
        assert type(ours) is type(theirs) and ours == theirs


VALUES = torch.tensor([[1.5, -2.0, 0.0, 3.25], [-0.5, 4.0, -1.0, 2.0], [0.25, -3.0, 5.0, -4.5]])
WEIGHT = torch.arange(8, dtype=torch.float32).reshape(4, 2) / 7 - 0.5

# (name, op over (x, w)): each runs on torch's tensors and on tensord's holding the same values
OPS: list[tuple[str, Callable[[Any, Any], Any]]] = [
    # elementwise, operators and their reflections
    ("add", lambda x, w: x + 1),
    ("radd", lambda x, w: 2.5 + x),
    ("rsub", lambda x, w: 1 - x),
    ("mul", lambda x, w: x * x),
    ("truediv", lambda x, w: x / 3),
    ("floordiv", lambda x, w: x // 2),
    ("mod", lambda x, w: x % 2),
    ("pow", lambda x, w: x**2),
    ("rpow", lambda x, w: 2**x),
    ("neg", lambda x, w: -x),
    ("abs", lambda x, w: abs(x)),
    ("torch.add alpha", lambda x, w: torch.add(x, x, alpha=2)),
    ("exp", lambda x, w: x.exp()),
    ("torch.sigmoid", lambda x, w: torch.sigmoid(x)),
    ("clamp", lambda x, w: x.clamp(-1, 1)),
    ("where", lambda x, w: torch.where(x > 0, x, torch.zeros(()))),
    ("lerp", lambda x, w: torch.lerp(x, x * 2, 0.25)),
    # reductions
    ("sum", lambda x, w: x.sum()),
    ("sum dim", lambda x, w: x.sum(dim=1, keepdim=True)),
    ("mean", lambda x, w: torch.mean(x, 0)),
    ("max dim", lambda x, w: x.max(dim=1)),
    ("min", lambda x, w: x.min()),
    ("argmax", lambda x, w: x.argmax()),
    ("std", lambda x, w: x.std(dim=0)),
    ("norm", lambda x, w: x.norm()),
    ("cumsum", lambda x, w: torch.cumsum(x, dim=1)),
    ("topk", lambda x, w: x.topk(2)),
    ("sort", lambda x, w: torch.sort(x, dim=0)),
    # matmul and linear
    ("matmul", lambda x, w: x @ w),
    ("torch.matmul", lambda x, w: torch.matmul(x, w)),
    ("mm transposed", lambda x, w: torch.mm(w.t(), x.t())),
    ("einsum", lambda x, w: torch.einsum("ij,jk->ik", x, w)),
    ("linear", lambda x, w: F.linear(x, w.t())),
    # comparisons
    ("gt", lambda x, w: x > 0),
    ("le", lambda x, w: x <= 1.5),
    ("eq", lambda x, w: x == x),
    ("ne", lambda x, w: x != 0),
    ("eq torch", lambda x, w: torch.eq(x, 2.0)),
    ("equal", lambda x, w: torch.equal(x, x)),
    ("allclose", lambda x, w: torch.allclose(x, x + 1e-9)),
    # mask indexing (torch's mask; tensord's own indexing returns a tensord tensor)
    ("masked_select", lambda x, w: torch.masked_select(x, x > 0)),
    ("nonzero", lambda x, w: torch.nonzero(x > 0)),
    # joins
    ("cat", lambda x, w: torch.cat([x, x * 2], dim=0)),
    ("stack", lambda x, w: torch.stack((x, x))),
    ("cat with torch", lambda x, w: torch.cat([x, torch.ones(1, 4)])),
    # nn.functional
    ("relu", lambda x, w: F.relu(x)),
    ("gelu", lambda x, w: F.gelu(x)),
    ("softmax", lambda x, w: F.softmax(x, dim=-1)),
    ("log_softmax", lambda x, w: F.log_softmax(x, dim=0)),
    ("layer_norm", lambda x, w: F.layer_norm(x, (4,))),
    ("mse_loss", lambda x, w: F.mse_loss(x, x * 0.5)),
    ("cross_entropy", lambda x, w: F.cross_entropy(x, torch.tensor([0, 3, 1]))),
    ("pad", lambda x, w: F.pad(x, (1, 1))),
    # dtypes: the results' own
    ("to int and sum", lambda x, w: torch.sum(x.to(torch.int64))),
    ("sum dtype", lambda x, w: x.sum(dtype=torch.float64)),
    ("bool any", lambda x, w: (x > 4).any()),
    ("bfloat16 add", lambda x, w: x.to(torch.bfloat16) + 1),
]


@pytest.mark.parametrize(("name", "op"), OPS, ids=[name for name, _ in OPS])
def test_torch_ops_on_tensord_tensors_equal_torchs(
    client: tensord.Client, name: str, op: Callable[[Any, Any], Any]
) -> None:
    x, w = client.tensor(VALUES.numpy()), client.tensor(WEIGHT.numpy())
    same(op(x, w), op(VALUES.clone(), WEIGHT.clone()))
    assert x.tolist() == VALUES.tolist()  # out of place: the pool is unchanged


def test_a_result_torch_gives_as_its_input_is_the_tensord_tensor(client: tensord.Client) -> None:
    x = client.tensor(VALUES.numpy())
    assert F.dropout(x, training=False) is x  # torch returns its input itself


def test_mask_indexing_equals_torchs(client: tensord.Client) -> None:
    x = client.tensor(VALUES.numpy())
    picked = x[x > 0]  # tensord's own indexing, with torch's mask
    assert isinstance(picked, tensord.Tensor)
    assert picked.dtype == torch.float32 and picked.tolist() == VALUES[VALUES > 0].tolist()


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.int64, torch.int32, torch.bool, torch.bfloat16]
)
def test_elementwise_ops_keep_torchs_result_dtypes(client: tensord.Client, dtype: Any) -> None:
    values = (VALUES * 2).to(dtype)
    x = client.tensor(values)
    assert x.dtype == dtype
    for op in (lambda v: v + 1, lambda v: v * 0.5, lambda v: v.sum(), lambda v: v > 0):
        same(op(x), op(values))


def test_views_and_lazy_bits_alias_what_they_read(client: tensord.Client) -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    x = client.tensor(t)
    for ours, theirs in (
        (x.t(), t.t()),
        (x[1:, ::2], t[1:, ::2]),
        (x.reshape(4, 3), t.reshape(4, 3)),
    ):
        same(ours * 2, theirs * 2)
    c = torch.complex(t, -t)
    z = client.tensor(c)
    same(z.conj() + 0, c.conj() + 0)
    same(z.conj().imag * 1, c.conj().imag * 1)  # the negative bit
    same(z.real.sum(), c.real.sum())


# ---- in place: the pooled bytes -------------------------------------------------------------


def test_in_place_ops_write_the_pool_and_return_the_tensord_tensor(client: tensord.Client) -> None:
    x = client.tensor(VALUES.numpy())
    w = client.full((3, 4), 2.0)
    expected = VALUES.clone()
    assert x.add_(1) is x
    expected.add_(1)
    assert x.mul_(w) is x
    expected.mul_(2.0)
    y = x
    x += 1
    assert x is y
    expected += 1
    out = client.zeros(3, 4)
    assert torch.sub(x, 0.5, out=out) is out
    assert x.tolist() == expected.tolist()  # read back through the SDK (its own path)
    assert out.tolist() == (expected - 0.5).tolist()
    row = x[1]  # a tensord view: torch writes its elements only
    row.zero_()
    row.sub_(3)
    expected[1] = -3
    assert x.tolist() == expected.tolist()


def test_in_place_errors_are_torchs_and_write_nothing(client: tensord.Client) -> None:
    x, t = client.arange(4), torch.arange(4)
    for op in (lambda v: v.add_(0.5), lambda v: v.mul_(torch.ones(2))):
        with pytest.raises(RuntimeError) as theirs:
            op(t)
        with pytest.raises(RuntimeError) as ours:
            op(x)
        assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)
    assert x.tolist() == [0, 1, 2, 3]


def test_torch_reads_the_writes_queued_before_it(client: tensord.Client) -> None:
    x = client.zeros(1000)
    x.sum()  # the alias exists now
    x.fill_(2.0)  # queued (pipelined) on the server
    x[:10] = 1.0
    assert x.sum().item() == 2.0 * 990 + 10
    x.resize_(2000)  # the Storage may have grown: aliases are made again
    x[1000:] = 3.0
    assert x[1000:].sum().item() == 3000.0 and x.sum().item() == 2.0 * 990 + 10 + 3000.0


def test_torch_waits_for_queued_writes_only(client: tensord.Client) -> None:
    x = client.zeros(4, 4)
    x.sum()
    conn = x._session.conn  # the SDK's own connection, its waits counted here
    waits = []
    original = conn.synchronize

    def counted(*args: Any, **kwargs: Any) -> None:
        waits.append(args)
        original(*args, **kwargs)

    # the connection's and its pipeline's (what settle calls): each wait counted once
    conn.synchronize = counted
    conn.pipeline.synchronize = counted
    try:
        for row in range(4):
            assert (x[row] + 1).tolist() == [1.0] * 4  # a queued view writes nothing: no wait
            assert x.t()[row].sum().item() == 0.0
        assert waits == []
        x[1:].fill_(2.0)  # a queued write: torch's next read waits for it, once
        assert x.sum().item() == 24.0 and x[0].sum().item() == 0.0
        assert len(waits) == 1
    finally:
        conn.synchronize = original
        del conn.pipeline.synchronize


def test_one_export_per_storage_however_many_ops(client: tensord.Client) -> None:
    x = client.tensor(VALUES.numpy())
    views = [x, x.t(), x[1], x.reshape(12)]
    mapper = x._session.local  # the SDK's own same-host mapper, counted here
    calls = []
    original = mapper.shared_export

    def counted(*args: Any) -> Any:
        calls.append(args)
        return original(*args)

    mapper.shared_export = counted
    try:
        for _ in range(50):
            for view in views:
                view.exp().sum()
    finally:
        mapper.shared_export = original
    assert len(calls) == 1
    alias = tensord.as_torch(x)
    assert alias.data_ptr() == np.asarray(x, copy=False).ctypes.data  # the pooled bytes


WAIT_S = 60.0


def run_child(address: str, code: str, *args: str) -> str:
    """``code`` in a fresh interpreter with ``client`` connected (the server's host: mapped)."""
    return run_client_child(address, code, *args, imports="json, torch", timeout=WAIT_S)


@pytest.mark.slow
def test_in_place_ops_are_seen_by_another_process(client: tensord.Client) -> None:
    x = client.tensor(VALUES.numpy())
    x.add_(1)
    seen = run_child(
        client.address,
        """
        y = client.attach(sys.argv[2])
        print(json.dumps(y.tolist()))
        y.mul_(2)                      # torch writes the pool from there...
        torch.neg(y[0], out=y[0])
        """,
        x.share(),
    )
    assert json.loads(seen) == (VALUES + 1).tolist()
    expected = (VALUES + 1) * 2
    expected[0] = -expected[0]
    assert x.tolist() == expected.tolist()  # ...and this one sees it
    same(x + 0, expected)


# ---- modules on pooled weights, from two processes -----------------------------------------

MLP = "torch.nn.Sequential(torch.nn.Linear(1024, 2048, **kw), torch.nn.ReLU(), torch.nn.Linear(2048, 2048, **kw), torch.nn.GELU(), torch.nn.Linear(2048, 1024, **kw))"
ENCODER = "torch.nn.TransformerEncoderLayer(512, 8, dim_feedforward=4096, dropout=0.0, batch_first=True, **kw)"

CHILD = """
import sys, json, tensord, torch
client = tensord.connect(sys.argv[1])

def rss_anon():  # this process's own memory (a mapping of the pool is shared memory)
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))

prefix, build, shape, source = sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5]
kw = {"device": "meta"}  # no weights of its own: they come from the pool
model = eval(build).eval()
names = list(model.state_dict())
if source == "local":  # the control: the same forward on weights made here, before measuring
    state = {name: torch.randn(value.shape) for name, value in model.state_dict().items()}
torch.manual_seed(1)
inputs = torch.randn(*shape)
before = rss_anon()
if source == "pool":
    state = tensord.as_torch({name: client.get(prefix + name) for name in names})
model.load_state_dict(state, assign=True)
with torch.no_grad():
    out = model(inputs)
    out = model(inputs)
grown = rss_anon() - before
print(json.dumps({"out": out.tolist(), "grown": grown, "allocated": client.memory_allocated()}))
sys.stdout.flush()
sys.stdin.read()  # holds the weights until the parent has seen every child's report
client.close()
"""


def start_child(address: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, address, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("build", "shape"), [(MLP, [8, 1024]), (ENCODER, [2, 16, 512])], ids=["mlp", "encoder"]
)
def test_a_module_on_pooled_weights_runs_from_two_processes(
    fresh_server: Any, build: str, shape: list[int]
) -> None:
    torch.manual_seed(0)
    local = eval(build, {"torch": torch, "kw": {}}).eval()
    with tensord.connect(fresh_server.address) as client:
        prefix = f"weights-{os.getpid()}-{time.monotonic_ns()}/"
        before = client.memory_allocated()
        weights = 0
        for name, value in local.state_dict().items():
            client.put(prefix + name, client.tensor(value))
            weights += value.nbytes
        held = client.memory_allocated()
        assert held - before >= weights
        torch.manual_seed(1)
        with torch.no_grad():
            expected = local(torch.randn(*shape))
        args = (prefix, build, json.dumps(shape))
        control = start_child(fresh_server.address, *args, "local")
        baseline, _ = control.communicate("", timeout=WAIT_S)
        assert control.returncode == 0, control.stderr
        forward_growth = json.loads(baseline)["grown"]  # torch's own workspace, no weights
        children = [start_child(fresh_server.address, *args, "pool") for _ in range(2)]
        try:
            reports = [json.loads(child.stdout.readline() or "null") for child in children]
        finally:
            for child in children:
                child.communicate("", timeout=WAIT_S)
        for child, report in zip(children, reports, strict=True):
            assert report is not None, child.stderr
            torch.testing.assert_close(torch.tensor(report["out"]), expected)
            # a copy of the weights would add their size to the control's growth
            assert report["grown"] < forward_growth + weights / 4, (report, forward_growth)
            assert report["allocated"] == held  # both hold them: still the one copy
        assert client.memory_allocated() == held


def test_load_state_dict_assign_runs_a_module_on_pooled_weights(client: tensord.Client) -> None:
    torch.manual_seed(0)
    local = torch.nn.Linear(4, 3)
    state = collections.OrderedDict((k, client.tensor(v)) for k, v in local.state_dict().items())
    model = torch.nn.Linear(4, 3, device="meta")
    model.load_state_dict(tensord.as_torch(state), assign=True)
    inputs = torch.randn(2, 4)
    same(model(inputs).detach(), local(inputs).detach())
    with torch.no_grad():
        model.weight.mul_(2)  # a Parameter over the pool: the write lands there
    assert state["weight"].tolist() == (local.weight * 2).tolist()


def test_load_state_dict_of_tensord_tensors_copies_or_says_to_use_as_torch(
    client: tensord.Client,
) -> None:
    torch.manual_seed(0)
    local = torch.nn.Linear(4, 3)
    state = {k: client.tensor(v) for k, v in local.state_dict().items()}
    copied = torch.nn.Linear(4, 3)
    copied.load_state_dict(state)  # without assign: torch copies into its own parameters
    assert torch.equal(copied.weight, local.weight) and torch.equal(copied.bias, local.bias)
    with pytest.raises(
        RuntimeError, match=r"load_state_dict\(tensord.as_torch\(state\), assign=True\)"
    ):
        torch.nn.Linear(4, 3, device="meta").load_state_dict(state, assign=True)
    with pytest.raises(TypeError, match=r"cannot be a torch\.nn\.Parameter"):
        torch.nn.Parameter(state["weight"])


# ---- dtypes and devices ------------------------------------------------------------------------


def test_dtypes_and_devices_compare_equal_to_torchs_both_ways(client: tensord.Client) -> None:
    x = client.ones(2)
    assert x.dtype == torch.float32 and torch.float32 == x.dtype and x.dtype is torch.float32
    assert tensord.float32 == torch.float32 and torch.float32 == tensord.float32
    assert tensord.float32 != torch.float64 and torch.int64 != tensord.float32
    assert tensord.bfloat16 == torch.bfloat16 and tensord.int == torch.int32
    assert x.device == torch.device("cpu") and torch.device("cpu") == x.device
    assert x.device == "cpu" and x.device != torch.device("cuda:0")
    assert hash(x.device) == hash("cpu") and {tensord.float32: 1}[tensord.float32] == 1


def test_torch_takes_tensord_dtypes_and_devices(client: tensord.Client) -> None:
    x = client.ones(2, 3)
    same(torch.zeros(3, dtype=x.dtype, device=x.device), torch.zeros(3))
    same(torch.zeros_like(x, dtype=x.dtype), torch.zeros(2, 3))
    f64 = tensord.dtypes.float64  # a DType: torch's Python functions take it too
    same(F.softmax(x, 0, dtype=f64), F.softmax(torch.ones(2, 3), 0, dtype=torch.float64))
    same(x.sum(dtype=f64), torch.ones(2, 3).sum(dtype=torch.float64))
    assert x.to(torch.float16).dtype == tensord.float16  # tensord's own to() takes torch's


DTYPE_NAMES = (
    "bfloat16", "bool", "cdouble", "cfloat", "complex64", "complex128", "double", "float",
    "float16", "float32", "float64", "half", "int", "int8", "int16", "int32", "int64", "long",
    "short", "uint8", "uint16", "uint32", "uint64",
)  # fmt: skip


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_torch_factories_take_the_packages_dtype_names(name: str) -> None:
    # no tensord tensor in the call: torch's C++ parser sees tensord.<name> itself
    dtype = getattr(tensord, name)
    assert dtype is getattr(torch, name)
    assert torch.zeros(3, dtype=dtype).dtype is getattr(torch, name)
    assert dtype == getattr(tensord.dtypes, name) and getattr(tensord.dtypes, name) == dtype


def assert_runs_fresh(code: str) -> None:
    """``code``'s assertions hold in a fresh interpreter (an import order of its own)."""
    run = subprocess.run(
        [sys.executable, "-c", code + "print('ok')\n"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


@pytest.mark.slow
def test_the_packages_dtype_names_are_dtypes_until_torch_is_imported() -> None:
    code = (
        "import sys, tensord\n"
        "early = tensord.float32\n"
        "assert type(early) is tensord.DType and 'torch' not in sys.modules\n"
        "import torch\n"
        "assert tensord.float32 is torch.float32 and early == torch.float32\n"
        "from tensord import int64\n"
        "assert torch.ones(2, dtype=int64).dtype is torch.int64\n"
        "assert type(tensord.dtypes.float32) is tensord.DType\n"
    )
    assert_runs_fresh(code)


@pytest.mark.slow
def test_with_torch_imported_first_the_dtypes_hash_as_torchs() -> None:
    # equal objects hash alike: either kind finds the other as a dict key or set member
    code = (
        "import torch, tensord.dtypes as d\n"
        f"names = {DTYPE_NAMES!r}\n"
        "for name in names:\n"
        "    ours, theirs = getattr(d, name), getattr(torch, name)\n"
        "    assert ours == theirs and hash(ours) == hash(theirs), name\n"
        "    assert {theirs: name}[ours] == name and {ours: name}[theirs] == name, name\n"
        "    assert ours in {theirs} and theirs in {ours}, name\n"
        "assert len({d.float32, d.float64, torch.float32, torch.float64}) == 2\n"
    )
    assert_runs_fresh(code)


# ---- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op",
    [
        lambda x: x @ x,
        lambda x: torch.cat([x, x.t()]),
        lambda x: x.sum(dim=5),
        lambda x: F.linear(x, x.t()),
        lambda x: x.view_as_complex_nope(),
    ],
)
def test_errors_keep_torchs_types_and_texts(
    client: tensord.Client, op: Callable[[Any], Any]
) -> None:
    with pytest.raises(Exception) as theirs:
        op(torch.ones(2, 3))
    with pytest.raises(Exception) as ours:
        op(client.ones(2, 3))
    assert isinstance(ours.value, type(theirs.value))
    assert str(ours.value).replace("'Tensor' object", "") == str(theirs.value).replace(
        "'Tensor' object", ""
    )


def test_a_view_torch_cannot_alias_says_why(client: tensord.Client) -> None:
    z = client.tensor(torch.complex(torch.ones(4), torch.ones(4)))
    odd = z.conj().imag.as_strided((2,), (3,), 0)  # a negative bit on no complex elements
    with pytest.raises(NotImplementedError, match=r"call x.resolve_neg\(\) first"):
        odd + 1


# ---- a client without the mapping ---------------------------------------------------------------


def test_a_remote_client_refuses_and_names_the_ways(server: Any, policy: None) -> None:
    with tensord.connect(server.address, local=False) as remote:
        x = remote.ones(3)
        with pytest.raises(tensord.FailedPreconditionError) as caught:
            x + 1
        assert isinstance(caught.value, RuntimeError)
        text = str(caught.value)
        for way in ("x.numpy()", "x.copy_(result)", "set_torch_policy('download')", "local=False"):
            assert way in text
        assert x.tolist() == [1.0, 1.0, 1.0]


def test_a_remote_client_downloads_when_asked(server: Any, policy: None) -> None:
    tensord.set_torch_policy("download")
    with tensord.connect(server.address, local=False) as remote:
        x = remote.tensor(VALUES.numpy())
        same(torch.matmul(x, WEIGHT), VALUES @ WEIGHT)
        same(F.relu(x), F.relu(VALUES))
        assert x.mul_(2) is x  # the copy's result goes back into the pool
        assert x.tolist() == (VALUES * 2).tolist()
        b = remote.tensor(VALUES.to(torch.bfloat16))
        b.add_(1)
        assert b.tolist() == (VALUES.to(torch.bfloat16) + 1).tolist()


def test_set_torch_policy_refuses_an_unknown_policy(policy: None) -> None:
    with pytest.raises(ValueError, match=r"policy must be one of 'raise', 'download', got 'copy'"):
        tensord.set_torch_policy("copy")
    assert tensord.torch_policy() == "raise"


def test_the_sdk_imports_without_torch() -> None:
    code = (
        "import sys, tensord; sys.modules['torch'] = None\n"
        "import tensord.tensor, tensord.client\n"
        "assert tensord.float32 == tensord.dtypes.float32 and tensord.as_torch({'a': 1}) == {'a': 1}\n"
        "try:\n"
        "    tensord._torch.load_torch()\n"
        "except TypeError as missing:\n"
        "    print('needs torch (pip install torch)' in str(missing))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
