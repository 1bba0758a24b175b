"""The view layers' lean launches (kiln/runtime/view_launches.py): each the same tensor as its op, bit for bit, with
the same sizes, strides, storage offset and storage (a view where the op views, a copy where it copies), at random
shapes and strides; the programs that take them equal to the ops' and to onnxruntime."""

from __future__ import annotations

import zlib

import numpy as np
import onnxruntime as ort
import pytest
import torch

import kiln
from kiln.ops import tensor as tensor_ops
from kiln.runtime import program as program_module, view_launches, view_steps
from kiln.runtime.step import pinned_fp32
from kiln.runtime.view_launches import lean_launch
from tests.unit.llama_engine import llama_segments  # noqa: F401  (the fixture: its attentions unfused)

# fp32 logits of two decoder layers against onnxruntime's: summation orders differ (kiln's GEMMs, attention)
RTOL = ATOL = 1e-4
OPS = {"Reshape": tensor_ops.reshape, "Expand": tensor_ops.expand, "Unsqueeze": tensor_ops.unsqueeze,
       "Squeeze": tensor_ops.squeeze, "Transpose": tensor_ops.transpose}


def _input(rng, sizes: tuple[int, ...]) -> torch.Tensor:
    """A float tensor of `sizes`, laid out one of four ways: contiguous; a permutation of a contiguous one; a slice
    (storage offset > 0, the strides of a larger tensor); a dim broadcast from 1 (stride 0)."""
    def normal(shape):
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))

    way = int(rng.integers(4))
    if way == 1 and len(sizes) > 1:
        perm = [int(p) for p in rng.permutation(len(sizes))]
        base = [0] * len(sizes)
        for k, p in enumerate(perm):
            base[p] = sizes[k]
        return normal(base).permute(perm)  # [sizes]: dim k is the base's perm[k]
    if way == 2 and sizes:
        return normal((sizes[0] + 1, *sizes[1:-1], sizes[-1] + 2))[1:, ..., 1:-1] if len(sizes) > 1 \
            else normal((sizes[0] + 1,))[1:]
    if way == 3 and sizes:
        k = int(rng.integers(len(sizes)))
        return normal((*sizes[:k], 1, *sizes[k + 1:])).expand(*sizes)
    return normal(sizes)


def _same(lean, op, x, *rest, **attributes) -> None:
    """`lean` and the op on the same arguments: the same exception type, or the same tensor in every respect."""
    try:
        want = op(None, x, *rest, **attributes)
    except Exception as e:  # noqa: BLE001  the lean launch must refuse alike
        with pytest.raises(type(e)):
            lean(None, x, *rest, **attributes)
        return
    got = lean(None, x, *rest, **attributes)
    assert (got.shape, got.stride(), got.storage_offset(), got.dtype) == \
        (want.shape, want.stride(), want.storage_offset(), want.dtype)
    shares = got.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert shares == (want.untyped_storage().data_ptr() == x.untyped_storage().data_ptr())
    assert torch.equal(got, want)


def _sizes(rng, rank: int) -> tuple[int, ...]:
    return tuple(int(d) for d in rng.choice([1, 1, 2, 3, 4, 5, 7, 8], size=rank))


def _reshape_target(rng, sizes: tuple[int, ...], allowzero: int) -> list[int]:
    """A target for `sizes`: dims merged or split, some kept as 0 (allowzero 0) or one inferred (-1); now and then
    one that does not fit (the op raises)."""
    dims = list(sizes)
    if len(dims) > 1 and rng.random() < 0.4:  # merge two neighbours
        k = int(rng.integers(len(dims) - 1))
        dims[k:k + 2] = [dims[k] * dims[k + 1]]
    if rng.random() < 0.3:  # split a dim off as (d, 1)
        k = int(rng.integers(len(dims)))
        dims[k:k + 1] = [dims[k], 1]
    target = list(dims)
    if not allowzero:
        for k in range(min(len(target), len(sizes))):
            if target[k] == sizes[k] and rng.random() < 0.4:
                target[k] = 0
    if rng.random() < 0.3:
        target[int(rng.integers(len(target)))] = -1
    if rng.random() < 0.05:
        target[int(rng.integers(len(target)))] += 1  # (does not fit)
    return target


@pytest.mark.parametrize("op_type", sorted(OPS))
def test_lean_launch_equals_its_op_at_random_shapes_and_strides(op_type):
    """One launch (its kept entries carried from call to call, as a layer's are) against the op on 300 random
    inputs: contiguous, permuted, sliced; targets, axes and perms drawn for each. The shape (axes) tensors are reused
    across inputs of other sizes, so an entry kept for one input's sizes meets another's."""
    op = OPS[op_type]
    lean = lean_launch(op_type, "", op)
    rng = np.random.default_rng(zlib.crc32(op_type.encode()))
    reused: list[torch.Tensor] = []
    for _ in range(300):
        rank = int(rng.integers(1, 5))
        sizes = _sizes(rng, rank)
        x = _input(rng, sizes)
        if op_type == "Reshape":
            allowzero = int(rng.integers(2))
            shape = torch.tensor(_reshape_target(rng, sizes, allowzero), dtype=torch.int64)
            if reused and rng.random() < 0.3:
                shape = reused[int(rng.integers(len(reused)))]  # (kept for another input's sizes)
            reused.append(shape)
            _same(lean, op, x, shape, allowzero=allowzero)
        elif op_type == "Expand":
            target = [int(rng.choice([d, 1, 3])) if d == 1 else int(rng.choice([d, d, 1, d + 1])) for d in sizes]
            if rng.random() < 0.2:
                target = [int(rng.integers(1, 4))] + target  # a longer target (the op's own path)
            shape = torch.tensor(target, dtype=torch.int64)
            if reused and rng.random() < 0.3:
                shape = reused[int(rng.integers(len(reused)))]
            reused.append(shape)
            _same(lean, op, x, shape)
        elif op_type == "Unsqueeze":
            count = int(rng.integers(1, 3))
            out_rank = rank + count
            axes = rng.choice(np.arange(-out_rank, out_rank), size=count, replace=False)
            axes = torch.tensor(axes, dtype=torch.int64)
            if reused and rng.random() < 0.3:
                axes = reused[int(rng.integers(len(reused)))]
            reused.append(axes)
            _same(lean, op, x, axes)
        elif op_type == "Squeeze":
            ones = [k for k, d in enumerate(sizes) if d == 1]
            picked = [k - rank if rng.random() < 0.5 else k for k in ones if rng.random() < 0.6]
            if rng.random() < 0.1:
                picked.append(int(rng.integers(rank)))  # (a dim that may not be 1: the op raises)
            axes = torch.tensor(picked, dtype=torch.int64)  # (empty: every size-1 dim)
            if reused and rng.random() < 0.3:
                axes = reused[int(rng.integers(len(reused)))]
            reused.append(axes)
            _same(lean, op, x, axes)
        else:
            perm = [int(p) for p in rng.permutation(rank)]
            _same(lean, op, x, perm=perm if rng.random() < 0.9 else None)


def test_lean_launch_reads_what_ints_reads_and_leaves_the_rest_to_the_op():
    """A shape input that is no 1-D integer tensor (2-D, float, int32), an input that is no tensor (a numpy array:
    a string graph's path), a target with zeros that follow the input's sizes from call to call, an empty tensor."""
    rng = np.random.default_rng(zlib.crc32(b"lean fallbacks"))
    reshape = lean_launch("Reshape", "", tensor_ops.reshape)
    x = torch.from_numpy(rng.standard_normal((2, 3, 4)).astype(np.float32))
    _same(reshape, tensor_ops.reshape, x, torch.tensor([[2, 12]]))
    _same(reshape, tensor_ops.reshape, x, torch.tensor([6, 4], dtype=torch.int32))
    _same(reshape, tensor_ops.reshape, x, torch.tensor([6.0, 4.0]))
    strings = np.array([["a", "b"], ["c", "d"]], dtype=object)
    assert (reshape(None, strings, torch.tensor([4])) == tensor_ops.reshape(None, strings, torch.tensor([4]))).all()
    zeros = torch.tensor([0, 0, -1], dtype=torch.int64)  # (the same tensor: its entry per input size)
    for sizes in [(2, 3, 4), (5, 1, 2), (2, 3, 4), (3, 2, 2, 2), (0, 3, 4)]:
        _same(reshape, tensor_ops.reshape, _input(rng, sizes), zeros, allowzero=0)
    _same(reshape, tensor_ops.reshape, torch.empty(0, 3), torch.tensor([0, 3]), allowzero=1)
    expand = lean_launch("Expand", "", tensor_ops.expand)
    _same(expand, tensor_ops.expand, torch.empty(1, 0), torch.tensor([3, 0]))
    _same(expand, tensor_ops.expand, x, torch.tensor([2, -1, 4]))  # (does not broadcast: both raise)


def test_a_meta_input_keeps_no_view():
    """On meta tensors (no storage: every address 0) a Reshape that copies is not taken for a view; a real input of
    the same sizes and strides after it gets the op's copy."""
    reshape = lean_launch("Reshape", "", tensor_ops.reshape)
    target = torch.tensor([3, 16])
    x = torch.empty(3, 4, 4, device="meta").transpose(1, 2)  # (not viewable as [3, 16])
    for _ in range(2):
        reshape(None, x, target, allowzero=0)
    real = torch.from_numpy(np.random.default_rng(7).standard_normal((3, 4, 4)).astype(np.float32)).transpose(1, 2)
    for _ in range(3):
        _same(reshape, tensor_ops.reshape, real, target, allowzero=0)


def test_kept_entries_are_bounded(monkeypatch):
    """Past KEPT entries a layer starts over; every call still its op's."""
    monkeypatch.setattr(view_launches, "KEPT", 3)
    rng = np.random.default_rng(zlib.crc32(b"lean kept"))
    reshape = lean_launch("Reshape", "", tensor_ops.reshape)
    kept = next(c.cell_contents for c in reshape.__closure__ if isinstance(c.cell_contents, view_launches._Kept))
    shapes = [torch.tensor([-1, d], dtype=torch.int64) for d in (1, 2, 3, 4, 6, 12)]
    for k in range(40):
        _same(reshape, tensor_ops.reshape, _input(rng, (2, 3, 2)), shapes[k % len(shapes)])
        assert len(kept) <= 3


def test_lean_launch_only_for_the_ops_own_implementation():
    """A launch that is not the registered implementation (a tactic's, a pinned-fp32 wrapper) keeps its own."""
    assert lean_launch("Reshape", "", tensor_ops.reshape) is not None
    assert lean_launch("Reshape", "", pinned_fp32(tensor_ops.reshape)) is None
    assert lean_launch("Reshape", "com.microsoft", tensor_ops.reshape) is None
    assert lean_launch("Flatten", "", tensor_ops.flatten) is None
    assert lean_launch("Transpose", "", tensor_ops.reshape) is None


def _kept(launch) -> view_launches._Kept:
    return next(c.cell_contents for c in launch.__closure__ if isinstance(c.cell_contents, view_launches._Kept))


@pytest.mark.parametrize("case", [*sorted(OPS), "Reshape that copies"])
def test_a_kept_view_is_the_ops_view_at_another_offset(case):
    """Inputs of the sizes and strides met before, at other storage offsets and with other values: the kept (sizes,
    strides) as_strided at each one's offset is the op's tensor in every respect; a Reshape that copied keeps no view
    and copies again."""
    rng = np.random.default_rng(zlib.crc32(b"kept " + case.encode()))
    base = torch.from_numpy(rng.standard_normal((5, 4, 6)).astype(np.float32))
    inputs = [base[k:k + 3, :, 1:5] for k in (0, 2, 1)]  # [3, 4, 4], strides (24, 6, 1), offsets 1, 49, 25
    op_type = case.split()[0]
    if op_type == "Transpose":
        other, attributes = [], {"perm": [2, 0, 1]}
    elif case == "Reshape":
        other, attributes = [torch.tensor([0, 0, 2, -1])], {"allowzero": 0}  # (the last dim split: a view)
    elif op_type == "Reshape":
        other, attributes = [torch.tensor([0, 16])], {"allowzero": 0}  # (dims 1 and 2 merged: not viewable)
    elif op_type == "Expand":
        inputs = [x[:, :1] for x in inputs]
        other, attributes = [torch.tensor([3, 7, 4])], {}
    elif op_type == "Unsqueeze":
        other, attributes = [torch.tensor([-1, 1])], {}
    else:
        inputs = [x[:, :1] for x in inputs]
        other, attributes = [torch.tensor([1])], {}
    launch = lean_launch(op_type, "", OPS[op_type])
    for x in inputs:
        _same(launch, OPS[op_type], x, *other, **attributes)
    (entry,) = _kept(launch).values()
    assert (entry[2] is None) == (case == "Reshape that copies")


def _context(path, monkeypatch, lean: bool, record: bool):
    monkeypatch.setenv("KILN_PAD_FIRST_CALLS", "0")  # every shape runs at its own sizes
    monkeypatch.setattr(program_module, "LEAN_VIEWS", lean)
    context = kiln.load(str(path)).create_execution_context()
    context.warm_up()
    if not record:
        context.engine.program.signature_views = None
    return context


def test_llama_with_lean_views_equals_the_ops_and_onnxruntime_at_random_shapes(llama_segments, monkeypatch):
    """llama_tiny at 14 random shapes of its profile (1x1..4x16: batches and sequences of 1 among them), each called
    3 times, on three engines: the ops' own implementations with nothing recorded (the reference), main's (the ops,
    a signature's views recorded at its 2nd call, view_steps.py), and the lean launches (the default). Every call bit
    for bit the reference's at that shape, and onnxruntime's within fp32 tolerance. On the lean engine every one of
    the 34 view layers takes its launch, no op's implementation runs, the shape's list of recorded views
    (view_steps.py) is made at its 2nd call from what the launches kept (every one of the 34 in it), and from its 3rd
    call each layer that views (28 of the 34 at least: 6 Reshapes copy where no size is 1) is one as_strided."""
    exported, path = llama_segments
    reference = _context(path, monkeypatch, lean=False, record=False)
    main = _context(path, monkeypatch, lean=False, record=True)
    context = _context(path, monkeypatch, lean=True, record=True)
    program = context.engine.program
    launches = [s.fn for s in program.lean_steps if getattr(s.fn, "__module__", "") == view_launches.__name__]
    assert len(launches) == 34  # every view layer between the segments (test_view_steps: 34)
    assert not any(getattr(s.fn, "__module__", "") == view_launches.__name__ for s in main.engine.program.steps)
    ops = {name: getattr(tensor_ops, name) for name in ("reshape_to", "expand_to", "unsqueeze_axes", "squeeze_axes")}
    called: list[str] = []
    strided: list[int] = []
    as_strided = torch.Tensor.as_strided
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng()  # fresh shapes every run (the failing one named by the assertion)
    shapes = [(int(rng.integers(1, 5)), int(rng.integers(1, 17))) for _ in range(12)] + [(1, 1), (4, 1)]
    for shape in shapes:
        feeds = {"input_ids": rng.integers(0, 100, shape, dtype=np.int64)}
        feeds = {n: feeds.get(n, np.ones(shape, np.int64)) for n in reference.engine.input_names}
        want = next(iter(reference.run(feeds).values()))
        np.testing.assert_allclose(want, session.run(None, feeds)[0], rtol=RTOL, atol=ATOL, err_msg=str(shape))
        for _ in range(3):
            np.testing.assert_array_equal(next(iter(main.run(feeds).values())), want, err_msg=str(shape))
        for call in range(3):
            with monkeypatch.context() as patch:
                for name, op in ops.items():
                    patch.setattr(tensor_ops, name, lambda *a, _name=name, _op=op: called.append(_name) or _op(*a))
                patch.setattr(torch.Tensor, "as_strided", lambda *a: strided.append(1) or as_strided(*a))
                strided.clear()
                got = next(iter(context.run(feeds).values()))
            np.testing.assert_array_equal(got, want, err_msg=str(shape))
            assert not called, (shape, called)
            assert call < 2 or len(strided) >= 28, (shape, len(strided))
        views = program.signature_views  # the shape's list, made at its 2nd call from what the launches kept
        recorded = views._lists[next(reversed(views._lists))]
        made = [recorded[i].fn for i in views._positions]
        assert all(type(m) in (view_steps._Strided, view_steps._Reshaped) and m.fn in launches for m in made), shape
