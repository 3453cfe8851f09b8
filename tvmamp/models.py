"""Built-in Relax models with random weights: SimpleNet, a conv net and a transformer layer.

Each builder returns ``(mod, params)``: ``main`` takes the data inputs first, then the
parameters (``num_input`` attribute), and ``params`` holds seeded random values for them, so a
model can be built with ``tvmamp.build(mod, params=params)``.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax


class _Builder:
    """Collects parameters with seeded random values while a function is being built."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.params: list[relax.Var] = []
        self.values: dict[str, np.ndarray] = {}

    def param(self, name: str, shape, scale: float, offset: float = 0.0) -> relax.Var:
        var = relax.Var(name, relax.TensorType(shape, "float32"))
        value = offset + scale * self.rng.standard_normal(shape)
        self.params.append(var)
        self.values[name] = value.astype("float32")
        return var

    def positive(self, name: str, shape, low: float, high: float) -> relax.Var:
        """A parameter with values in ``[low, high]`` or ``[1/high, 1/low]``, never near 1.

        For batch-norm running variances: half the channels well below 1 and half well above
        (log-uniform magnitudes, random signs of the log), so a BN that ignores the variance,
        or uses ``1/var`` or ``var`` for ``1/sqrt(var)``, gives visibly wrong outputs.
        """
        var = relax.Var(name, relax.TensorType(shape, "float32"))
        log = self.rng.uniform(np.log(low), np.log(high), shape)
        value = np.exp(log * self.rng.choice([-1.0, 1.0], shape))
        self.params.append(var)
        self.values[name] = value.astype("float32")
        return var


def _linear(bb, b: _Builder, x, name, n_in, n_out):
    w = b.param(f"{name}.weight", (n_out, n_in), 1.0 / np.sqrt(n_in))
    bias = b.param(f"{name}.bias", (n_out,), 0.1)
    y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w)))
    return bb.emit(relax.op.add(y, bias))


def _function(name_inputs, body, seed):
    """Build ``main(*inputs, *params)`` with ``body(bb, builder, *inputs) -> output``."""
    bb = relax.BlockBuilder()
    builder = _Builder(seed)
    inputs = [relax.Var(n, relax.TensorType(s, "float32")) for n, s in name_inputs]
    with bb.function("main"):
        with bb.dataflow():
            out = bb.emit_output(body(bb, builder, *inputs))
        bb.emit_func_output(out, params=[*inputs, *builder.params])
    mod = bb.get()
    mod["main"] = mod["main"].with_attr("num_input", len(inputs))
    return mod, builder.values


def simple_net(batch: int = 256, hidden: int = 1024, layers: int = 9, seed: int = 0):
    """Paddle's AMP-guide SimpleNet: ``layers`` x Linear(hidden) with ReLU between them."""

    def body(bb, b, x):
        for i in range(layers):
            x = _linear(bb, b, x, f"linear{i}", hidden, hidden)
            if i < layers - 1:
                x = bb.emit(relax.op.nn.relu(x))
        return x

    return _function([("x", (batch, hidden))], body, seed)


def conv_net(batch: int = 1, channels: int = 16, size: int = 16, blocks: int = 2, seed: int = 0):
    """``blocks`` x (conv3x3 + batch_norm + relu), then global average pool and a linear head.

    The batch norms run in inference mode with seeded random running statistics: means of
    scale 0.5 and variances in [0.2, 0.5] or [2, 5] (never 1, so the variance matters).
    """

    def body(bb, b, x):
        c_in = 3
        for i in range(blocks):
            w = b.param(f"conv{i}.weight", (channels, c_in, 3, 3), 1.0 / np.sqrt(9 * c_in))
            gamma = b.param(f"bn{i}.weight", (channels,), 0.1, 1.0)
            beta = b.param(f"bn{i}.bias", (channels,), 0.1)
            mean = b.param(f"bn{i}.running_mean", (channels,), 0.5)
            var = b.positive(f"bn{i}.running_var", (channels,), 2.0, 5.0)
            x = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
            bn = bb.emit(relax.op.nn.batch_norm(x, gamma, beta, mean, var, axis=1, training=False))
            x = bb.emit(relax.op.nn.relu(bb.emit(relax.TupleGetItem(bn, 0))))
            c_in = channels
        x = bb.emit(relax.op.mean(x, axis=[2, 3]))
        return _linear(bb, b, x, "head", channels, 10)

    return _function([("x", (batch, 3, size, size))], body, seed)


def transformer_layer(batch: int = 2, seq: int = 16, dim: int = 64, heads: int = 4, seed: int = 0):
    """A post-norm transformer encoder layer: attention (matmul + softmax), layer_norm, GELU MLP."""
    head_dim = dim // heads

    def split_heads(bb, t):
        t = bb.emit(relax.op.reshape(t, (batch, seq, heads, head_dim)))
        return bb.emit(relax.op.permute_dims(t, (0, 2, 1, 3)))

    def layer_norm(bb, b, x, name):
        g = b.param(f"{name}.weight", (dim,), 0.1, 1.0)
        beta = b.param(f"{name}.bias", (dim,), 0.1)
        return bb.emit(relax.op.nn.layer_norm(x, g, beta, axes=[-1]))

    def body(bb, b, x):
        q, k, v = (split_heads(bb, _linear(bb, b, x, f"attn.{n}", dim, dim)) for n in "qkv")
        kt = bb.emit(relax.op.permute_dims(k, (0, 1, 3, 2)))
        scores = bb.emit(relax.op.matmul(q, kt))
        scores = bb.emit(relax.op.multiply(scores, relax.const(1.0 / np.sqrt(head_dim), "float32")))
        attn = bb.emit(relax.op.matmul(bb.emit(relax.op.nn.softmax(scores, axis=-1)), v))
        attn = bb.emit(relax.op.permute_dims(attn, (0, 2, 1, 3)))
        attn = bb.emit(relax.op.reshape(attn, (batch, seq, dim)))
        x = layer_norm(
            bb, b, bb.emit(relax.op.add(x, _linear(bb, b, attn, "attn.out", dim, dim))), "ln1"
        )
        h = bb.emit(relax.op.nn.gelu(_linear(bb, b, x, "mlp.fc1", dim, 4 * dim)))
        return layer_norm(
            bb, b, bb.emit(relax.op.add(x, _linear(bb, b, h, "mlp.fc2", 4 * dim, dim))), "ln2"
        )

    return _function([("x", (batch, seq, dim))], body, seed)


def overflow_net(batch: int = 8, dim: int = 64, seed: int = 0):
    """A model plain fp16 O1/O2 breaks: an energy term h*h*s overflows fp16 (65504).

    ``out = head(tanh(h) + 1e-5 * energy)`` with ``h = linear(x)`` of magnitude ~30 and
    ``energy = h * h * 100`` up to ~1e5; every op on the path is an elementwise (follow) op that
    O1 and O2 run in the low dtype.
    """

    def body(bb, b, x):
        h = _linear(bb, b, x, "proj", dim, dim)
        h = bb.emit(relax.op.multiply(h, relax.const(30.0, "float32")))
        energy = bb.emit(relax.op.multiply(bb.emit(relax.op.multiply(h, h)), relax.const(100.0)))
        mixed = bb.emit(
            relax.op.add(
                bb.emit(relax.op.tanh(h)), bb.emit(relax.op.multiply(energy, relax.const(1e-5)))
            )
        )
        return _linear(bb, b, mixed, "head", dim, 10)

    return _function([("x", (batch, dim))], body, seed)


MODELS = {
    "simplenet": simple_net,
    "convnet": conv_net,
    "transformer": transformer_layer,
    "overflow": overflow_net,
}


def get_model(name: str, **kwargs):
    """A built-in model by name (see ``MODELS``)."""
    if name not in MODELS:
        raise ValueError(
            f"tvmamp: unknown built-in model {name!r}; choose from {', '.join(MODELS)}"
        )
    return MODELS[name](**kwargs)


def example_inputs(mod: tvm.IRModule, seed: int = 1) -> list[np.ndarray]:
    """Random inputs matching the data inputs of ``main``: non-zero normal floats in each
    input's float dtype, integers in ``[0, 8)`` (token ids and positions any vocabulary
    accepts), random bools.

    Raises ValueError, naming the input, when an input has a symbolic dimension (pass a static
    shape: ``--input-shape`` on the command line).
    """
    from .tensors import np_dtype, static_shape

    func = mod["main"]
    n = (
        int(func.attrs["num_input"])
        if func.attrs and "num_input" in func.attrs
        else len(func.params)
    )
    rng = np.random.default_rng(seed)
    inputs = []
    for param in func.params[:n]:
        shape, dtype = static_shape(param.ty), str(getattr(param.ty, "dtype", "float32"))
        if shape is None:
            raise ValueError(
                f"tvmamp: input {param.name!r} has shape {_dims(param.ty.shape)} with "
                "symbolic dimensions; random example inputs need a static shape (on the "
                "command line: --input-shape NAME=D0,D1,...)"
            )
        if dtype == "bool":
            inputs.append(rng.integers(0, 2, shape).astype(bool))
        elif dtype.startswith(("int", "uint")):
            inputs.append(rng.integers(0, 8, shape).astype(dtype))
        else:
            inputs.append(rng.standard_normal(shape).astype(np_dtype(dtype)))
    return inputs


def _dims(shape) -> str:
    """``[batch, 3, 16, 16]``: a shape's static sizes as numbers, symbolic ones by name."""
    from .tensors import dim_texts

    return "[" + ", ".join(dim_texts(shape)) + "]"
