"""Default mixed-precision op lists: every Relax op, in exactly one category.

The lists start from TVM's ``TMixedPrecisionPolicy`` op attribute (0 = always, 1 = follow,
missing = never) and are corrected with the lists users know from Paddle (``amp_lists.py``),
MindSpore (``amp.py``) and PyTorch autocast (``autocast_mode.h``):

- ``WHITE`` (TVM's "always"): GEMM-like ops, which gain most from low precision and accumulate
  in fp32 (``out_dtype``).
- ``BLACK`` (TVM's "never"): ops whose range or accumulation needs fp32 below O3: exp/log/pow
  families, reductions, softmax, norms, losses, scatters and interpolation.
- ``PROMOTE``: ops that run in the widest float dtype of their inputs.
- ``FOLLOW`` (gray, TVM's "follow"): elementwise, shape and data-movement ops; their dtype
  depends on the level and on their inputs.
- ``FIXED``: ops that do not compute on floats, or whose dtypes are fixed by the program
  (builtins, packed/TIR calls, creation ops with a dtype attribute, quantisation). The pass never
  changes them and gives them their inputs in the original dtypes.

Each tuple holds the default members of the :class:`tvmamp.Category` of the same name (white and
black are the words Paddle, MindSpore and ``tvmamp.get_white_list`` use).
``tests/test_op_lists.py`` proves that every registered ``relax.*`` op sits in exactly one list.

User op names (``custom_white_list``, ``custom_black_list``) are matched case-insensitively
against Relax names (``"Exp"`` is ``relax.exp``), then ``OP_ALIASES``, then ``NO_RELAX_OP``, so the
lists of Paddle, MindSpore and PyTorch can be pasted as they are
(``tests/test_framework_op_names.py``). A framework name maps to the Relax op it is imported as,
or to the one Relax op that holds its computation (``expm1`` -> ``exp``, ``log1p`` -> ``log``,
``addmm`` -> ``matmul``). A framework op that TVM imports as general arithmetic, or cannot import
at all, is in ``NO_RELAX_OP``: listing it warns once and changes nothing.
"""

WHITE = (
    "relax.matmul",
    "relax.outer",
    "relax.einsum",
    "relax.nn.conv1d",
    "relax.nn.conv2d",
    "relax.nn.conv3d",
    "relax.nn.conv1d_transpose",
    "relax.nn.conv2d_transpose",
    "relax.nn.conv3d_transpose",
    "relax.nn.attention",
    "relax.nn.attention_bias",
    "relax.nn.attention_var_len",
    "relax.nn.prelu",
)

# TVM's sort kernels order bf16 values wrongly (torch.sort of 8 values at O2 came back
# unsorted), its bf16 argmax fails to compile ("Check failed: StructuralEqual()(value->ty,
# var->ty)") and its bf16 median returns values that are not in the input (torch.median at
# O2 gave -1.16 for 0.05); these ops only compare and move values, so fp32 costs only the
# casts. (kthvalue, mode and nanmedian do not import; quantile imports as argsort and
# gather_elements.)
ORDER_STATISTICS = (
    "relax.sort",
    "relax.argsort",
    "relax.topk",
    "relax.argmax",
    "relax.argmin",
    "relax.median",
)

BLACK = (
    # transcendental ops with a narrow fp16 range (Paddle, MindSpore, PyTorch black lists)
    "relax.exp",
    "relax.log",
    "relax.log_add_exp",
    "relax.power",
    "relax.square",
    "relax.rsqrt",
    "relax.tan",
    "relax.acos",
    "relax.asin",
    "relax.sinh",
    "relax.cosh",
    "relax.atanh",
    # reductions and scans accumulate in fp32
    "relax.sum",
    "relax.mean",
    "relax.prod",
    "relax.variance",
    "relax.std",
    "relax.cumsum",
    "relax.cumprod",
    "relax.collapse_sum_like",
    "relax.collapse_sum_to",
    # softmax, norms and losses
    "relax.nn.softmax",
    "relax.nn.log_softmax",
    "relax.nn.softplus",
    "relax.nn.layer_norm",
    "relax.nn.group_norm",
    "relax.nn.instance_norm",
    "relax.nn.rms_norm",
    "relax.nn.batch_norm",
    "relax.nn.cross_entropy_with_logits",
    "relax.nn.nll_loss",
    "relax.grad.nll_loss_backward",
    "relax.grad.take_backward",
    # Paddle's extra black list for O1/O2: lookup_table, scatter and the interp ops
    "relax.take",
    "relax.scatter_elements",
    "relax.scatter_nd",
    "relax.image.resize2d",
    "relax.image.resize3d",
    *ORDER_STATISTICS,
)

PROMOTE = (
    "relax.atan2",
    "relax.ewise_fma",
    "relax.image.grid_sample",
    "relax.index_put",
    "relax.slice_scatter",
)

FOLLOW = (
    "relax.abs",
    "relax.acosh",
    "relax.add",
    "relax.asinh",
    "relax.atan",
    "relax.broadcast_to",
    "relax.bucketize",
    "relax.ceil",
    "relax.clip",
    "relax.concat",
    "relax.cos",
    "relax.divide",
    "relax.dynamic_strided_slice",
    "relax.equal",
    "relax.erf",
    "relax.expand_dims",
    "relax.flatten",
    "relax.flip",
    "relax.floor",
    "relax.floor_divide",
    "relax.floor_mod",
    "relax.full_like",
    "relax.gather_elements",
    "relax.gather_nd",
    "relax.grad.avg_pool2d_backward",
    "relax.grad.max_pool2d_backward",
    "relax.greater",
    "relax.greater_equal",
    "relax.image.affine_grid",
    "relax.index_tensor",
    "relax.isfinite",
    "relax.isinf",
    "relax.isnan",
    "relax.layout_transform",
    "relax.less",
    "relax.less_equal",
    "relax.max",
    "relax.maximum",
    "relax.meshgrid",
    "relax.min",
    "relax.minimum",
    "relax.mod",
    "relax.multiply",
    "relax.negative",
    "relax.nn.adaptive_avg_pool1d",
    "relax.nn.adaptive_avg_pool2d",
    "relax.nn.adaptive_avg_pool3d",
    "relax.nn.avg_pool1d",
    "relax.nn.avg_pool2d",
    "relax.nn.avg_pool3d",
    "relax.nn.batch_flatten",
    "relax.nn.dropout",
    "relax.nn.gelu",
    "relax.nn.gelu_tanh",
    "relax.nn.leakyrelu",
    "relax.nn.max_pool1d",
    "relax.nn.max_pool2d",
    "relax.nn.max_pool3d",
    "relax.nn.pad",
    "relax.nn.pixel_shuffle",
    "relax.nn.relu",
    "relax.nn.selu",
    "relax.nn.silu",
    "relax.nonzero",
    "relax.not_equal",
    "relax.ones_like",
    "relax.permute_dims",
    "relax.repeat",
    "relax.reshape",
    "relax.reverse_sequence",
    "relax.round",
    "relax.sigmoid",
    "relax.sign",
    "relax.sin",
    "relax.split",
    "relax.sqrt",
    "relax.squeeze",
    "relax.stack",
    "relax.strided_slice",
    "relax.subtract",
    "relax.tanh",
    "relax.tile",
    "relax.tril",
    "relax.triu",
    "relax.trunc",
    "relax.unique",
    "relax.vision.roi_align",
    "relax.vision.roi_pool",
    "relax.where",
    "relax.zeros_like",
)

# Ops that TVM cannot lower, or lowers wrongly, in bfloat16. They stay fp32 at every level, O3
# included, when the low dtype is bfloat16 (float16 kernels work):
# - topi's layer_norm, group_norm and instance_norm accept only float32 and float16, and topi's
#   batch_norm returns float32 for a bfloat16 input (its epsilon promotes), which breaks FuseTIR;
# - Relax's prelu rejects bfloat16 ("Prelu requires the input tensor to have float dtype") and
#   topi's log_add_exp and tirx's pow fail their IsFloatType checks on it ("power only applies
#   to float": torch.pow at O3);
# - LLVM has no bfloat16 isnan/isinf/isfinite ("Data type T.bfloat16 not supported for isnan
#   op": torch.nan_to_num), mod (torch.fmod: "dtype mismatch on BufferStore: buffer's dtype is
#   T.uint16 ... bfloat16x32") nor slice_scatter (F.pad(mode="circular"), circular convolutions:
#   "IntImm can only take scalar, but boolx32 was supplied");
# - topi's grid_sample returns float32 for bfloat16 inputs (its coordinate constants promote),
#   and the op after it failed to build at O3 ("Binary operators must have the same datatype");
# - the black-listed ORDER_STATISTICS (sort, argsort, topk, argmax, argmin, median)
#   give wrong values or fail to compile in bfloat16, which O3 would otherwise ask for.
# The tests, flags and selections among them are exact in fp32, so fp32 costs only the casts.
NO_BFLOAT16 = (
    "relax.nn.batch_norm",
    "relax.nn.group_norm",
    "relax.nn.instance_norm",
    "relax.nn.layer_norm",
    "relax.nn.prelu",
    "relax.log_add_exp",
    "relax.power",
    "relax.isnan",
    "relax.isinf",
    "relax.isfinite",
    "relax.mod",
    "relax.slice_scatter",
    "relax.image.grid_sample",
    *ORDER_STATISTICS,
)

# Ops whose output dtype the program fixes (an explicit dtype attribute), ops that do not compute
# on floats, and runtime builtins. ``relax.astype`` and ``relax.wrap_param`` are explicit casts:
# the pass feeds them whatever dtype it has and drops them when they become no-ops.
FIXED = (
    "relax.arange",
    "relax.assert_op",
    "relax.astype",
    "relax.bitwise_and",
    "relax.bitwise_not",
    "relax.bitwise_or",
    "relax.bitwise_xor",
    "relax.builtin.alloc_tensor",
    "relax.builtin.stop_lift_params",
    "relax.call_builtin_with_ctx",
    "relax.call_dps_packed",
    "relax.call_inplace_packed",
    "relax.call_pure_packed",
    "relax.call_py_func",
    "relax.call_tir",
    "relax.call_tir_inplace",
    "relax.call_tir_with_grad",
    "relax.ccl.allgather",
    "relax.ccl.allreduce",
    "relax.ccl.broadcast_from_worker0",
    "relax.ccl.scatter_from_worker0",
    "relax.dequantize",
    "relax.dist.annotate_sharding",
    "relax.dist.call_tir_local_view",
    "relax.dist.redistribute",
    "relax.dist.redistribute_replica_to_shard",
    "relax.eye",
    "relax.eye_like",
    "relax.full",
    "relax.grad.end_checkpoint",
    "relax.grad.no_grad",
    "relax.grad.start_checkpoint",
    "relax.hamming_window",
    "relax.hint_on_device",
    "relax.inspect.tensor_byte_offset",
    "relax.inspect.tensor_dtype_bits",
    "relax.inspect.tensor_dtype_code",
    "relax.inspect.tensor_dtype_lanes",
    "relax.inspect.tensor_elem_offset",
    "relax.inspect.tensor_ndim",
    "relax.inspect.tensor_shape_i",
    "relax.inspect.tensor_stride_i",
    "relax.invoke_closure",
    "relax.invoke_pure_closure",
    "relax.left_shift",
    "relax.logical_and",
    "relax.logical_not",
    "relax.logical_or",
    "relax.logical_xor",
    "relax.make_closure",
    "relax.memory.alloc_storage",
    "relax.memory.alloc_tensor",
    "relax.memory.ensure_zero_offset",
    "relax.memory.kill_storage",
    "relax.memory.kill_tensor",
    "relax.memory.view",
    "relax.multinomial_from_uniform",
    "relax.null_value",
    "relax.one_hot",
    "relax.ones",
    "relax.print",
    "relax.quantize",
    "relax.right_shift",
    "relax.shape_of",
    "relax.shape_to_tensor",
    "relax.size",
    "relax.tensor_to_shape",
    "relax.to_vdevice",
    "relax.vision.all_class_non_max_suppression",
    "relax.vision.get_valid_counts",
    "relax.vision.multibox_transform_loc",
    "relax.vision.non_max_suppression",
    "relax.vm.alloc_storage",
    "relax.vm.alloc_tensor",
    "relax.vm.call_tir_dyn",
    "relax.vm.kill_object",
    "relax.wrap_param",
    "relax.zeros",
)

# Fixed ops whose operands after the data (scale, zero point) are quantization parameters. The
# AMP pass computes the values a model makes only for them as written, fp32, at every level
# (``relay_passes/amp_quant_params.py``), as Paddle and MindSpore keep quantization fp32: ONNX
# DynamicQuantizeLinear imports as min/max reductions, ``(max - min) / 255`` and a rounded zero
# point, all follow ops, and in bf16 the scale came out 0.4 % off and up to 72 of 512 quantized
# values a step away from onnxruntime's. A value multiplied by the float cast of an integer
# result of a ``WHITE`` op (MatMulInteger, ConvInteger) is a dequantization scale too.
QUANTIZATION = ("relax.quantize", "relax.dequantize")

# Names users know from Paddle, MindSpore and PyTorch, matched case-insensitively.
OP_ALIASES = {
    # Paddle
    "conv2d": ("relax.nn.conv2d",),
    "depthwise_conv2d": ("relax.nn.conv2d",),
    "conv2d_transpose": ("relax.nn.conv2d_transpose",),
    "conv3d": ("relax.nn.conv3d",),
    "matmul": ("relax.matmul",),
    "matmul_v2": ("relax.matmul",),
    "mul": ("relax.matmul",),
    "fc": ("relax.matmul",),
    "fused_gemm_epilogue": ("relax.matmul",),
    "max_pool2d_with_index": ("relax.nn.max_pool2d",),
    "pool2d": ("relax.nn.max_pool2d", "relax.nn.avg_pool2d"),
    "elementwise_add": ("relax.add",),
    "elementwise_sub": ("relax.subtract",),
    "elementwise_mul": ("relax.multiply",),
    "elementwise_div": ("relax.divide",),
    "elementwise_pow": ("relax.power",),
    "elementwise_max": ("relax.maximum",),
    "elementwise_min": ("relax.minimum",),
    "reduce_sum": ("relax.sum",),
    "reduce_mean": ("relax.mean",),
    "reduce_prod": ("relax.prod",),
    "reduce_max": ("relax.max",),
    "reduce_min": ("relax.min",),
    "lookup_table": ("relax.take",),
    "lookup_table_v2": ("relax.take",),
    "scatter": ("relax.scatter_elements",),
    "fused_attention": ("relax.nn.attention",),
    "fused_feedforward": ("relax.matmul",),
    "expm1": ("relax.exp",),  # imported as exp(x) - 1
    "log2": ("relax.log",),  # imported as log(x) / log(2)
    "log10": ("relax.log",),
    "log1p": ("relax.log",),  # imported as log(1 + x)
    "softmin": ("relax.nn.softmax",),  # softmax(-x)
    "transpose2": ("relax.permute_dims",),
    "reshape2": ("relax.reshape",),
    "slice": ("relax.strided_slice",),
    "softmax_with_cross_entropy": ("relax.nn.cross_entropy_with_logits",),
    "sigmoid_cross_entropy_with_logits": ("relax.nn.cross_entropy_with_logits",),
    "cross_entropy": ("relax.nn.cross_entropy_with_logits",),
    "cross_entropy2": ("relax.nn.cross_entropy_with_logits",),
    "bilinear_interp_v2": ("relax.image.resize2d",),
    "nearest_interp_v2": ("relax.image.resize2d",),
    "trilinear_interp_v2": ("relax.image.resize3d",),
    # MindSpore (matched case-insensitively, so "Conv2D" and "conv2d" are one entry)
    "conv1d": ("relax.nn.conv1d",),
    "conv1dtranspose": ("relax.nn.conv1d_transpose",),
    "conv2dtranspose": ("relax.nn.conv2d_transpose",),
    "conv3dtranspose": ("relax.nn.conv3d_transpose",),
    "convolution": (
        "relax.nn.conv1d",
        "relax.nn.conv2d",
        "relax.nn.conv3d",
        "relax.nn.conv1d_transpose",
        "relax.nn.conv2d_transpose",
        "relax.nn.conv3d_transpose",
    ),
    "dense": ("relax.matmul",),
    "batchmatmul": ("relax.matmul",),
    "matmulext": ("relax.matmul",),
    "batchmatmulext": ("relax.matmul",),
    "ger": ("relax.outer",),
    "gridsampler2d": ("relax.image.grid_sample",),
    "addmm": ("relax.matmul",),
    "layernorm": ("relax.nn.layer_norm",),
    "groupnorm": ("relax.nn.group_norm",),
    "batchnorm": ("relax.nn.batch_norm",),
    "batchnorm1d": ("relax.nn.batch_norm",),
    "batchnorm2d": ("relax.nn.batch_norm",),
    "batchnorm3d": ("relax.nn.batch_norm",),
    "logsoftmax": ("relax.nn.log_softmax",),
    "reducesum": ("relax.sum",),
    "reducemean": ("relax.mean",),
    "reduceprod": ("relax.prod",),
    "cumsum": ("relax.cumsum",),
    "cumprod": ("relax.cumprod",),
    "realdiv": ("relax.divide",),
    "biasadd": ("relax.add",),
    "pow": ("relax.power",),
    "gelu": ("relax.nn.gelu",),
    "relu": ("relax.nn.relu",),
    "prelu": ("relax.nn.prelu",),
    "softmax": ("relax.nn.softmax",),
    "softplus": ("relax.nn.softplus",),
    # PyTorch
    "linear": ("relax.matmul",),
    "mm": ("relax.matmul",),
    "bmm": ("relax.matmul",),
    "baddbmm": ("relax.matmul",),
    "addbmm": ("relax.matmul",),
    "addmv": ("relax.matmul",),
    "addr": ("relax.outer",),
    "dot": ("relax.matmul",),
    "tensordot": ("relax.matmul",),
    "scatter_add": ("relax.scatter_elements",),  # scatter_elements(reduction="add")
    "nll_loss2d": ("relax.nn.nll_loss",),
    "conv_transpose1d": ("relax.nn.conv1d_transpose",),
    "conv_transpose2d": ("relax.nn.conv2d_transpose",),
    "conv_transpose3d": ("relax.nn.conv3d_transpose",),
    "scaled_dot_product_attention": ("relax.nn.attention",),
    "layer_norm": ("relax.nn.layer_norm",),
    "group_norm": ("relax.nn.group_norm",),
    "batch_norm": ("relax.nn.batch_norm",),
    "instance_norm": ("relax.nn.instance_norm",),
    "rms_norm": ("relax.nn.rms_norm",),
    "log_softmax": ("relax.nn.log_softmax",),
    "nll_loss": ("relax.nn.nll_loss",),
    "silu": ("relax.nn.silu",),
    "dropout": ("relax.nn.dropout",),
    "max_pool2d": ("relax.nn.max_pool2d",),
    "avg_pool2d": ("relax.nn.avg_pool2d",),
    "adaptive_avg_pool2d": ("relax.nn.adaptive_avg_pool2d",),
    "embedding": ("relax.take",),
    "interpolate": ("relax.image.resize2d",),
    "transpose": ("relax.permute_dims",),
    "cast": ("relax.astype",),
    "sub": ("relax.subtract",),
    "div": ("relax.divide",),
}

# Op names from the AMP lists of Paddle, MindSpore and PyTorch that have no Relax op of their own:
# TVM imports them as general arithmetic (reciprocal is a divide, a norm is a sum and a sqrt,
# most losses are several ops) or cannot import them (the RNN cells). Listing one in
# custom_white_list or custom_black_list warns once and changes nothing; the Relax ops a model
# imports them as keep their own categories. Matched case-insensitively.
NO_RELAX_OP = (
    # recurrent cells (MindSpore O1 white list, PyTorch autocast lower-precision list)
    "LSTMCell",
    "GRUCell",
    "RNNCell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    # elementwise and reduction ops imported as general arithmetic, or not at all
    "erfinv",
    "reciprocal",
    "logsumexp",
    "cos_sim",
    "cosine_similarity",
    "norm",
    "pnorm",
    "frobenius_norm",
    "nuclear_norm",
    "renorm",
    "dist",
    "cdist",
    "pdist",
    # promote-list ops imported as several ops
    "addcdiv",
    "addcmul",
    "cross",
    "bilinear",
    "GridSampler3D",
    # losses TVM has no op for
    "huber_loss",
    "mse_loss",
    "l1_loss",
    "kl_div",
    "KLDivLoss",
    "smooth_l1_loss",
    "SmoothL1Loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "BCEWithLogitsLoss",
    "soft_margin_loss",
    "SoftMarginLoss",
    "multilabel_margin_loss",
    "MultilabelMarginLoss",
    "multi_margin_loss",
    "MultiMarginLoss",
    "triplet_margin_loss",
    "TripletMarginLoss",
    "margin_ranking_loss",
    "hinge_embedding_loss",
    "cosine_embedding_loss",
    "poisson_nll_loss",
)
