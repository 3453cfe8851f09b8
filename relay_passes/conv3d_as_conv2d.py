"""Conv3dAsConv2d: 3-D convolutions as 2-D ones over depth windows, 3-D max pools as 2-D ones.

TVM legalizes ``conv3d`` with TOPI's generic loops, which no CPU rule of tvmamp schedules: a
two-layer video net (3 x 8 x 32 x 32 clips) took 53 ms in fp32 and 200 ms at O2, where
onnxruntime takes 1.2 ms. Each output depth ``od`` of a 3-D convolution reads ``KD`` input
frames, ``x[:, :, od * s_d + kd * d_d]`` (after depth padding); folding those frames into the
channels turns the conv into a 2-D one:

    frames = x padded in depth, sliced ``KD`` times (``kd * d_d`` on, stride ``s_d``)
    x2 = [N * OD, KD * C, H, W]     (channel ``kd * C + c``)
    w2 = w permuted to [F, KD, C, KH, KW] and reshaped to [F, KD * C, KH, KW]
    y = conv2d(x2, w2, strides, padding, dilation over H and W) -> [N, F, OD, OH, OW]

Each frame's channels stay contiguous in ``x2``, so that the copy that lays it out as rows
moves whole runs of channels (``c * KD + kd`` gathered one value per frame: 23 of 28 ms of a
(2+1)D block). A grouped conv folds ``c * KD + kd`` instead, which keeps each group's channels
together, with ``groups=g``. The 2-D conv takes every conv2d path of the target (the direct
conv, im2col + bf16 GEMM). The frame copy is ``KD / s_d`` times the input, the price of the
im2col over depth. ``NCDHW``/``OIDHW`` convs with static shapes or a symbolic batch (a dynamic
batch axis, where TVM's loops ran 20 times slower than the static build); others are left to
TVM's legalization.

``max_pool3d`` (``NCDHW``, the same shapes) is a 2-D max pool of ``[N, C * D, H, W]``, then the
maximum over each depth window of its frames (the depth padded with the lowest value): TVM's
loops for the 3-D pool ran at 0.4 GB/s.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import PyExprMutator

from tvmamp.tensors import static_shape, static_shape_but_batch

from .bindings import rewrite_functions

_CONV3D = tvm.ir.Op.get("relax.nn.conv3d")
_MAX_POOL3D = tvm.ir.Op.get("relax.nn.max_pool3d")


@tvm.transform.module_pass(opt_level=0, name="tvmamp.Conv3dAsConv2d")
class Conv3dAsConv2d:
    """Rewrite each NCDHW conv3d (static, or over a symbolic batch) as a conv2d over folded
    depth windows, and each NCDHW max_pool3d as a max_pool2d and a maximum over depth."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite the 3-D convolutions of every Relax function of ``mod``."""
        return rewrite_functions(mod, _Rewriter(mod))


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op == _MAX_POOL3D and _pool_rewritable(call):
            return self._max_pool(call)
        if call.op != _CONV3D or not _rewritable(call):
            return call
        bb, attrs = self.builder_, call.attrs
        data, weight = call.args
        n, c, d, h, w = static_shape_but_batch(data.ty)
        f, cg, kd, kh, kw = static_shape(weight.ty)
        out_d = static_shape_but_batch(call.ty)[2]
        (sd, sh, sw), (dd, dh, dw) = _ints(attrs.strides), _ints(attrs.dilation)
        front, top, left, back, bottom, right = _ints(attrs.padding)
        if front or back:
            pad = [0, 0, 0, 0, front, back, 0, 0, 0, 0]
            data = bb.emit(relax.op.nn.pad(data, pad))
        last = (out_d - 1) * sd + 1
        frames = [
            relax.op.strided_slice(data, [2], [k * dd], [k * dd + last], [sd]) for k in range(kd)
        ]
        groups = int(attrs.groups)
        if groups == 1:  # channel kd * C + c: each frame's channels stay contiguous
            stacked = relax.op.stack(frames, axis=1)  # [N, KD, C, OD, H, W]
            windows = relax.op.permute_dims(stacked, [0, 3, 1, 2, 4, 5])
            w2 = relax.op.permute_dims(weight, [0, 2, 1, 3, 4])  # [F, KD, C, KH, KW]
        else:  # channel c * KD + kd: each group's channels stay contiguous
            stacked = relax.op.stack(frames, axis=2)  # [N, C, KD, OD, H, W]
            windows = relax.op.permute_dims(stacked, [0, 3, 1, 2, 4, 5])
            w2 = weight
        x2 = bb.emit(relax.op.reshape(windows, (n * out_d, c * kd, h, w)))
        w2 = relax.op.reshape(w2, (f, cg * kd, kh, kw))
        y = bb.emit(
            relax.op.nn.conv2d(
                x2,
                w2,
                strides=(sh, sw),
                padding=(top, left, bottom, right),
                dilation=(dh, dw),
                groups=groups,
                out_dtype=attrs.out_dtype,
            )
        )
        out_h, out_w = static_shape_but_batch(call.ty)[3:]
        y = relax.op.reshape(y, (n, out_d, f, out_h, out_w))
        return relax.op.permute_dims(y, [0, 2, 1, 3, 4])

    def _max_pool(self, call: relax.Call) -> relax.Expr:
        """``max_pool3d`` as a 2-D max pool of ``[N, C * D, H, W]`` (a view), then the maximum
        of the ``KD`` depth frames of that: TVM's loops for the 3-D pool ran at 0.4 GB/s, 59
        of 203 ms of S3D. The 2-D pool reads the input once, in tvmamp's pooling kernel, and
        the frames' maximum reads its smaller result (taken first, the maximum was fused
        with the input's producers and recomputed them for every frame)."""
        bb, attrs = self.builder_, call.attrs
        data = call.args[0]
        n, c, d, h, w = static_shape_but_batch(data.ty)
        kd, kh, kw = _ints(attrs.pool_size)
        (sd, sh, sw), (dd, dh, dw) = _ints(attrs.strides), _ints(attrs.dilation)
        front, top, left, back, bottom, right = _ints(attrs.padding)
        out_d, out_h, out_w = static_shape_but_batch(call.ty)[2:]
        planes = bb.emit(relax.op.reshape(data, (n, c * d, h, w)))
        pooled = relax.op.nn.max_pool2d(
            planes,
            (kh, kw),
            (sh, sw),
            (top, left, bottom, right),
            (dh, dw),
            ceil_mode=bool(attrs.ceil_mode),
        )
        pooled = bb.emit(relax.op.reshape(bb.emit(pooled), (n, c, d, out_h, out_w)))
        last = (out_d - 1) * sd + 1
        # the depth padded with the lowest value up to what the last window reads (in ceil
        # mode, past the back padding)
        back = max(back, last + (kd - 1) * dd - front - d)
        if front or back:
            lowest = float(tvm.tirx.min_value(str(data.ty.dtype)).value)
            pad = [0, 0, 0, 0, front, back, 0, 0, 0, 0]
            pooled = bb.emit(relax.op.nn.pad(pooled, pad, pad_value=lowest))
        frames = [
            relax.op.strided_slice(pooled, [2], [k * dd], [k * dd + last], [sd]) for k in range(kd)
        ]
        deepest = frames[0]
        for frame in frames[1:]:
            deepest = relax.op.maximum(deepest, frame)
        return deepest


def _pool_rewritable(call: relax.Call) -> bool:
    attrs = call.attrs
    layouts = (attrs.layout, attrs.out_layout)
    shapes = (static_shape_but_batch(call.args[0].ty), static_shape_but_batch(call.ty))
    return layouts == ("NCDHW", "NCDHW") and None not in shapes and len(attrs.padding) == 6


def _ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _rewritable(call: relax.Call) -> bool:
    attrs = call.attrs
    layouts = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout)
    data, weight = call.args
    shapes = (
        static_shape_but_batch(data.ty),
        static_shape(weight.ty),
        static_shape_but_batch(call.ty),
    )
    return layouts == ("NCDHW", "OIDHW", "NCDHW") and None not in shapes and len(attrs.padding) == 6
