"""A depthwise conv's NCHW input and output moved to and from channels-innermost with 16 x 16
register transposes (:mod:`.transpose_intrin`).

The ``groups`` tiling (:func:`.grouped_conv.schedule_groups`) reads its input as
``[N, C / 16, H', W', 16]`` and finishes each register tile as ``[pixels, 16 channels]``. Both
copies are transposes of ``[16 channels, pixels]`` planes, which TVM vectorises as element
gathers and inserts. Each side here works on whole flat planes of 16 channels, so that a run of
16 pixels is one contiguous row whatever the image width, one group of channels at a time,
inside the conv's loop over groups (the group's data stays in cache):

* input: the padding block writes the group's padded planes flat, ``[16, H' * W']`` (the
  padding rows and columns loop-partitioned off, each row segment vectorised), then
  :func:`.transpose_intrin.rows_intrin` turns them into ``[H' * W', 16]``;
* output: the register tiles are written, epilogue applied, as rows ``[OH * OW, 16]``, then
  :func:`.transpose_intrin.planes_intrin` writes them into the group's 16 NCHW output planes.

Both intrinsics transpose 16 x 16 tiles, the last one overlapping the one before it when the
plane is not a multiple of 16 pixels (``49 = 3 * 16 + 1`` for 7 x 7).

Measured on Zen5, one thread, bf16 at O2 (conv + bias + ReLU, against onnxruntime fp32 in the
same process): 960 x 7 x 7 0.81x -> 1.09x, 144 x 56 x 56 stride 2 0.63x -> 0.96x; the conv
kernel of the latter 0.105 -> 0.069 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir
from tvm.s_tir.schedule import LoopRV, SBlockRV

from . import transpose_intrin as transpose
from .conv_common import ConvShape, padding_interior, vectorise_interior

SIDE = transpose.SIDE


def fits(shape: ConvShape, tile_g: int, dtype: str) -> bool:
    """Whether a conv with ``shape``, tiled ``tile_g`` groups a vector and accumulating in
    ``dtype``, is staged here: depthwise, 16 groups a vector, at least one tile of output."""
    return (
        (shape.cg, shape.fg, tile_g) == (1, 1, SIDE)
        and shape.oh * shape.ow >= SIDE
        and transpose.rows_intrin(dtype, SIDE) is not None
    )


@dataclass(frozen=True)
class InputStaging:
    """The blocks of a staged input (:func:`stage_input`) and the dtype of its planes."""

    staged: SBlockRV
    pad: SBlockRV
    dtype: str


def stage_input(sch: s_tir.Schedule, conv: SBlockRV, pad: SBlockRV) -> InputStaging | None:
    """Stage the conv's input, written by ``pad`` as ``[N, C, H', W']``, as
    ``[N, C / 16, H' * W', 16]`` (``pad`` writing flat planes); None (``sch`` untouched) when
    its dtype has no transpose. :func:`place_input` schedules the blocks."""
    source = sch.get(pad).writes[0].source
    height, width = (int(e) for e in source.shape[2:])
    if transpose.rows_intrin(str(source.dtype), height * width) is None:
        return None
    staged = sch.cache_read(conv, 0, "global")
    rows = lambda n, c, h, w: (n, c // SIDE, h * width + w, c % SIDE)  # noqa: E731
    sch.transform_layout(staged, ("write", 0), rows)
    # [N, C / 16, 16, H' * W']: the flat padded planes (the same memory as [N, C, H' * W']).
    sch.transform_layout(pad, ("write", 0), _planes(width))
    sch.transform_block_layout(staged, rows)
    return InputStaging(staged, pad, str(source.dtype))


def place_input(sch: s_tir.Schedule, staging: InputStaging, outer: LoopRV) -> None:
    """Stage each group's input inside ``outer``, the conv's loop over groups of 16 channels:
    the padding of its 16 planes (rows vectorised), then their transposes, so that the conv
    reads them from cache."""
    sch.compute_at(staging.staged, outer, preserve_unit_loops=True)
    sch.compute_at(staging.pad, outer, preserve_unit_loops=True)
    loops = sch.get_loops(staging.staged)
    # The pixels the conv reads (fewer than the plane's when a stride skips the last).
    pixels = loops[-2]
    intrin, llvm_ir = transpose.rows_intrin(staging.dtype, int(sch.get(pixels).extent))
    sch.annotate(loops[-3], "pragma_import_llvm", llvm_ir)
    sch.tensorize(sch.blockize(pixels), intrin)
    _vectorise_padding(sch, staging.pad)


def stage_output(
    sch: s_tir.Schedule, acc: SBlockRV, outer: LoopRV, rows: int | None = None
) -> bool:
    """Write the conv's finished tiles (block ``acc``, epilogue inlined, output ``[N, C, OH,
    OW]``) as rows ``[N, C / 16, OH * OW, 16]``, then, at the end of each iteration of
    ``outer`` (one group of 16 channels, or with ``rows`` a chunk of that many output rows of
    one), transpose those rows into the output's planes. False (``sch`` untouched) when the
    output dtype has no transpose, or for chunks of one row or of fewer than 16 pixels (their
    unit loop does not match the intrinsic)."""
    out = sch.get(acc).writes[0].source
    height, width = (int(e) for e in out.shape[2:])
    chunked = rows is not None
    rows = height if rows is None else rows
    if chunked and (rows < 2 or rows * width < SIDE):
        return False
    # TVM keeps bf16 intermediates in fp32 (BF16ComputeLegalize): bf16 rows are fp32 rows,
    # rounded by the transpose, as TVM rounds the store of a bf16 value.
    dtype = str(out.dtype)
    rows_dtype = "float32" if dtype == "bfloat16" else dtype
    found = transpose.planes_intrin(rows_dtype, dtype, rows, width)
    if found is None:
        return False
    copy = sch.cache_write(acc, 0, "global")
    if rows_dtype != dtype:
        sch.unsafe_set_dtype(acc, 0, rows_dtype)
    sch.transform_layout(
        acc, ("write", 0), lambda n, c, y, x: (n, c // SIDE, y * width + x, c % SIDE)
    )
    *_, c, y, x = sch.get_loops(acc)
    sch.reorder(y, x, c)
    sch.vectorize(c)
    sch.reverse_compute_at(copy, outer, preserve_unit_loops=True)
    n, c = sch.get_loops(copy)[-4:-2]
    sch.annotate(n, "pragma_import_llvm", found[1])
    sch.tensorize(sch.blockize(c), found[0])
    return True


def _planes(width: int):
    """``(n, c, y, x) -> (n, c / 16, c % 16, y * width + x)``: NCHW with flat planes."""
    return lambda n, c, y, x: (n, c // SIDE, c % SIDE, y * width + x)


def _vectorise_padding(sch: s_tir.Schedule, pad: SBlockRV) -> None:
    """Loop the padding block's rows and columns of zeros apart from the input's, each row
    segment vectorised, so that the interior is a plain vectorised copy."""
    vectorise_interior(sch, pad, padding_interior(sch, pad, 2), padding_interior(sch, pad, 3))
