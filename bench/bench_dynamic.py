"""Symbolic shapes on the CPU: dynamic-batch builds against static ones, and MoE layers.

- A Linear-GELU-Linear MLP and BERT-4L (``zoo_models``), each imported once with static
  shapes and once with ``from_torch(..., dynamic_batch=True)``, built at O2 bf16 and run at
  batch 1. The ratio is dynamic / static: what a symbolic batch costs. Errors are against
  torch fp32.
- Tiny mixture-of-experts language models from their Hugging Face configs (2 layers, hidden
  256, 8 experts, top-2, random weights, 128 tokens): each expert is a matmul over a run-time
  number of rows (``tvmamp/frontends/torch_moe.py``). Against torch autocast bf16, with each
  one's error against torch fp32.

- ONNX exports with dynamic axes, as ``torch.onnx.export(dynamic_axes=...)`` and Hugging Face
  exports make them: tiny ``transformers`` models (2 layers, width 256, random weights) with a
  symbolic batch and sequence (or number of audio samples), ViT and a small CNN with a
  symbolic batch, and the CNN and a small U-Net with a symbolic batch, height and width;
  torchvision and timm image classifiers (:data:`VISION`, when those packages are installed;
  random weights, 128 px) with a symbolic batch, and torchvision classifiers and segmentation
  models (:data:`DYNAMIC_SIZE`) with a symbolic batch, height and width. Each is imported
  with its symbolic axes and with a static ``shape_dict``, built at O2 bf16, and timed beside
  onnxruntime fp32 (one intra-op thread). Errors are against onnxruntime at two sizes for
  the symbolic build.

All variants of a row are timed in one process with ``paired_medians``.

Run: TVM_NUM_THREADS=1 python bench/bench_dynamic.py [--threads 1] [--repeat 9]
     [--sections rows moe onnx] [--models MODEL ...]
     (the image classifiers: --sections onnx --models tv_resnet18 ... poolformer_s12;
      with dynamic image sizes: --models "tv_resnet18, dynamic size" ...;
      video classifiers: --models video_r2plus1d_18 video_s3d)
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import tvm

import tvmamp
from tvmamp.benchmark import max_rel_error, paired_medians

sys.path.insert(0, os.path.dirname(__file__))
from zoo_models import ZOO, OutputOf  # noqa: E402

MOE = {
    "Mixtral": ("MixtralConfig", {"num_local_experts": 8}),
    "Qwen2-MoE": (
        "Qwen2MoeConfig",
        {"num_experts": 8, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 512},
    ),
    "OLMoE": ("OlmoeConfig", {"num_experts": 8}),
    "Qwen3-MoE": ("Qwen3MoeConfig", {"num_experts": 8, "moe_intermediate_size": 256}),
}


def _tensors(xs):
    return [tvm.runtime.tensor(np.ascontiguousarray(x.numpy())) for x in xs]


def _mlp():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)]
    return torch.nn.Sequential(*layers).eval(), [torch.randn(1, 64, 256)]


def _bert():
    entry = ZOO["bert"]
    return entry.build(), entry.inputs(100)


def dynamic_rows(repeat: int) -> None:
    print("| model | static | dynamic batch | dynamic / static | error static | error dynamic |")
    print("|---|---|---|---|---|---|")
    for name, make in (("MLP 256-1024-256, 64 tokens", _mlp), ("BERT-4L, 128 tokens", _bert)):
        model, xs = make()
        with torch.inference_mode():
            want = model(*xs).float().numpy()
        runs, outs = [], []
        for dynamic in (False, True):
            example = [torch.cat([x, x]) for x in xs] if dynamic else xs
            mod, params = tvmamp.from_torch(model, tuple(example), dynamic_batch=dynamic)
            exe = tvmamp.build(mod, "O2", "llvm", dtype="bfloat16", params=params)
            args = _tensors(xs)
            outs.append(np.asarray(exe(*[x.numpy() for x in xs]), dtype="float32"))
            runs.append(lambda exe=exe, args=args: exe.vm["main"](*args))
        static, dynamic = paired_medians(runs, repeat=repeat)
        errors = " | ".join(f"{max_rel_error(out, want):.1e}" for out in outs)
        print(
            f"| {name} | {static * 1e3:.3f} ms | {dynamic * 1e3:.3f} ms | "
            f"{dynamic / static:.2f} | {errors} |"
        )


def mixture_of_experts(repeat: int) -> None:
    import transformers

    print()
    print("| model | tvmamp O2 | torch autocast | O2 / autocast | error O2 | error autocast |")
    print("|---|---|---|---|---|---|")
    for name, (config_name, extra) in MOE.items():
        config = getattr(transformers, config_name)(
            vocab_size=32000,
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts_per_tok=2,
            use_cache=False,
            **extra,
        )
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        inner = transformers.AutoModel.from_config(config).eval()
        model = OutputOf(inner, "last_hidden_state", ("input_ids",)).eval()
        ids = torch.randint(0, 32000, (1, 128), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            want = model(ids).numpy()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                autocast = model(ids).float().numpy()
        mod, params = tvmamp.from_torch(model, (ids,))
        exe = tvmamp.build(mod, "O2", "llvm", dtype="bfloat16", params=params)
        got = np.asarray(exe(ids.numpy()), dtype="float32")
        args = _tensors([ids])

        def run_autocast(model=model, ids=ids):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(ids)

        with torch.inference_mode():
            ours, theirs = paired_medians(
                [lambda exe=exe, args=args: exe.vm["main"](*args), run_autocast], repeat=repeat
            )
        print(
            f"| {name} | {ours * 1e3:.2f} ms | {theirs * 1e3:.2f} ms | {ours / theirs:.2f} | "
            f"{max_rel_error(got, want):.1e} | {max_rel_error(autocast, want):.1e} |"
        )


_WIDTH = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024)
_AUDIO = dict(conv_dim=(64,) * 7, **_WIDTH)
# name -> (config class, model class, config arguments, input kind)
EXPORTS = {
    "BERT": ("BertConfig", "BertModel", dict(vocab_size=1000, **_WIDTH), "text"),
    "DistilBERT": (
        "DistilBertConfig",
        "DistilBertModel",
        dict(vocab_size=1000, dim=256, n_layers=2, n_heads=4, hidden_dim=1024),
        "text",
    ),
    "T5 encoder": (
        "T5Config",
        "T5EncoderModel",
        dict(vocab_size=1000, d_model=256, d_kv=64, d_ff=1024, num_layers=2, num_heads=4),
        "text",
    ),
    "DeBERTa v1": ("DebertaConfig", "DebertaModel", dict(vocab_size=1000, **_WIDTH), "text"),
    "DeBERTa v2": ("DebertaV2Config", "DebertaV2Model", dict(vocab_size=1000, **_WIDTH), "text"),
    "ConvBERT": ("ConvBertConfig", "ConvBertModel", dict(vocab_size=1000, **_WIDTH), "text"),
    "MPT": (
        "MptConfig",
        "MptModel",
        dict(vocab_size=1000, d_model=256, n_heads=4, n_layers=2, expansion_ratio=4),
        "text",
    ),
    "XLNet": (
        "XLNetConfig",
        "XLNetModel",
        dict(vocab_size=1000, d_model=256, n_layer=2, n_head=4, d_inner=1024),
        "text",
    ),
    "wav2vec 2.0": ("Wav2Vec2Config", "Wav2Vec2Model", _AUDIO, "audio"),
    "HuBERT": ("HubertConfig", "HubertModel", _AUDIO, "audio"),
    "WavLM": ("WavLMConfig", "WavLMModel", _AUDIO, "audio"),
    "ViT": ("ViTConfig", "ViTModel", dict(image_size=64, patch_size=8, **_WIDTH), "image"),
    "CNN": (None, None, None, "cnn"),
    "CNN, dynamic size": (None, None, None, "cnn_hw"),
}
# Image classifiers with a dynamic batch (random weights, 128 px): torchvision ("tv_" names)
# and timm, which the bench imports only when these are asked for (neither is a dependency of
# tvmamp; install them without their dependencies, beside the torch you have).
VISION = [
    "tv_resnet18",
    "tv_mobilenet_v3_small",
    "tv_efficientnet_b0",
    "tv_regnet_y_400mf",
    "tv_shufflenet_v2_x0_5",
    "tv_squeezenet1_1",
    "tv_mnasnet0_5",
    "tv_googlenet",
    "tf_efficientnet_b0",
    "convmixer_768_32",
    "poolformer_s12",
]
EXPORTS.update({name: (None, None, None, "vision") for name in VISION})
# Exported with a dynamic batch, height and width ("<name>, dynamic size"), as detection and
# segmentation models are: torchvision classifiers and segmentation models ("seg_" names,
# 5 classes), and a small U-Net (torch only).
DYNAMIC_SIZE = [
    "tv_resnet18",
    "tv_mobilenet_v3_small",
    "tv_efficientnet_b0",
    "tv_densenet121",
    "tv_swin_t",
    "seg_lraspp_mobilenet_v3_large",
    "seg_deeplabv3_mobilenet_v3_large",
]
EXPORTS.update({f"{name}, dynamic size": (None, None, None, "vision_hw") for name in DYNAMIC_SIZE})
EXPORTS["U-Net, dynamic size"] = (None, None, None, "unet_hw")
# torchvision video classifiers with a dynamic batch: (2+1)D convs, and S3D's 3-D max pools
# (S3D takes 16 frames of 224 px at least)
EXPORTS["video_r2plus1d_18"] = (None, None, None, "video")
EXPORTS["video_s3d"] = (None, None, None, "video_s3d")
_TORCHVISION_KINDS = ("vision", "vision_hw", "video", "video_s3d")
# input kind -> (input name, dynamic axes, the timed shape, a second shape checked)
_INPUTS = {
    "text": ("input_ids", {0: "batch", 1: "seq"}, (2, 128), (3, 77)),
    "audio": ("input_values", {0: "batch", 1: "samples"}, (2, 16000), (1, 12345)),
    "image": ("pixel_values", {0: "batch"}, (2, 3, 64, 64), (3, 3, 64, 64)),
    "cnn": ("x", {0: "batch"}, (2, 3, 112, 112), (3, 3, 112, 112)),
    "cnn_hw": ("x", {0: "batch", 2: "height", 3: "width"}, (2, 3, 112, 112), (1, 3, 64, 96)),
    "vision": ("x", {0: "batch"}, (2, 3, 128, 128), (3, 3, 128, 128)),
    "vision_hw": ("x", {0: "batch", 2: "height", 3: "width"}, (2, 3, 128, 128), (1, 3, 96, 160)),
    "unet_hw": ("x", {0: "batch", 2: "height", 3: "width"}, (2, 3, 128, 128), (1, 3, 96, 160)),
    "video": ("x", {0: "batch"}, (1, 3, 8, 64, 64), (2, 3, 8, 64, 64)),
    "video_s3d": ("x", {0: "batch"}, (1, 3, 16, 224, 224), (2, 3, 16, 224, 224)),
}


def _cnn() -> torch.nn.Module:
    """Conv-BN-ReLU blocks (strided, depthwise, pointwise), pooling and a classifier."""
    nn = torch.nn

    def block(ci, co, stride=1, groups=1, k=3):
        conv = nn.Conv2d(ci, co, k, stride, k // 2, groups=groups, bias=False)
        return nn.Sequential(conv, nn.BatchNorm2d(co), nn.ReLU())

    torch.manual_seed(0)
    layers = [block(3, 32, 2), block(32, 32, 1, 32), block(32, 64, 1, 1, 1), block(64, 64, 2)]
    layers += [block(64, 128, 2), nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    model = nn.Sequential(*layers, nn.Linear(128, 10)).eval()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.1, 0.1)
            module.running_var.uniform_(0.5, 1.5)
    return model


class _UNet(torch.nn.Module):
    """A small U-Net: three levels (16, 32, 64 channels), max-pool downsampling, bilinear and
    nearest upsampling, skip connections concatenated."""

    def __init__(self, width: int = 16):
        super().__init__()
        nn = torch.nn

        def block(ci, co):
            return nn.Sequential(
                nn.Conv2d(ci, co, 3, padding=1, bias=False),
                nn.BatchNorm2d(co),
                nn.ReLU(),
                nn.Conv2d(co, co, 3, padding=1),
                nn.ReLU(),
            )

        c = width
        self.d1, self.d2, self.d3 = block(3, c), block(c, 2 * c), block(2 * c, 4 * c)
        self.u2, self.u1 = block(6 * c, 2 * c), block(3 * c, c)
        self.head = nn.Conv2d(c, 2, 1)

    def forward(self, x):
        pool, up = torch.nn.functional.max_pool2d, torch.nn.functional.interpolate
        a = self.d1(x)
        b = self.d2(pool(a, 2))
        c = self.d3(pool(b, 2))
        u = self.u2(torch.cat([up(c, scale_factor=2.0, mode="bilinear"), b], 1))
        return self.head(self.u1(torch.cat([up(u, scale_factor=2.0, mode="nearest"), a], 1)))


class _SegmentationOutput(torch.nn.Module):
    """A torchvision segmentation model's ``out`` map."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)["out"]


def _vision(name: str) -> torch.nn.Module:
    """Model ``name`` of :data:`VISION` or :data:`DYNAMIC_SIZE`, random weights, its
    batch-norm statistics randomised (so that the norms are not identities)."""
    torch.manual_seed(0)
    if name.startswith("seg_"):
        import torchvision.models.segmentation

        builder = getattr(torchvision.models.segmentation, name[4:])
        options = {} if "lraspp" in name else {"aux_loss": False}
        model = builder(weights=None, weights_backbone=None, num_classes=5, **options)
        model = _SegmentationOutput(model)
    elif name.startswith("tv_"):
        import torchvision.models

        options = {"aux_logits": False, "init_weights": True} if name == "tv_googlenet" else {}
        model = getattr(torchvision.models, name[3:])(**options)
    elif name.startswith("video_"):
        import torchvision.models.video

        model = getattr(torchvision.models.video, name[6:])()
    else:
        import timm

        model = timm.create_model(name, pretrained=False)
    return _randomised_norms(model)


def _randomised_norms(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in eval mode with its batch-norm statistics randomised."""
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d | torch.nn.BatchNorm3d):
            module.running_mean.uniform_(-0.2, 0.2)
            module.running_var.uniform_(0.5, 1.5)
    return model.eval()


def _export(name: str, path: str) -> str:
    """Export model ``name`` of :data:`EXPORTS` to ``path`` with its dynamic axes; return its
    input kind."""
    config_name, model_name, arguments, kind = EXPORTS[name]
    if kind in ("cnn", "cnn_hw"):
        model = _cnn()
    elif kind in _TORCHVISION_KINDS:
        model = _vision(name.split(",")[0])
    elif kind == "unet_hw":
        torch.manual_seed(0)
        model = _randomised_norms(_UNet())
    else:
        import transformers

        config = getattr(transformers, config_name)(**arguments)
        config._attn_implementation = "eager"
        config.use_cache = False
        torch.manual_seed(0)
        inner = getattr(transformers, model_name)(config).eval()
        model = OutputOf(inner, "last_hidden_state", (_INPUTS[kind][0],)).eval()
    input_name, axes, shape, _ = _INPUTS[kind]
    with torch.no_grad():
        torch.onnx.export(
            model,
            (_example(kind, shape),),
            path,
            dynamo=False,
            input_names=[input_name],
            output_names=["out"],
            dynamic_axes={input_name: axes},
            opset_version=17,
        )
    return kind


def _example(kind: str, shape: tuple, numpy: bool = False):
    gen = torch.Generator().manual_seed(len(shape))
    if kind == "text":
        x = torch.randint(0, 1000, shape, generator=gen)
    else:
        x = torch.randn(shape, generator=gen)
    return x.numpy() if numpy else x


def onnx_exports(repeat: int, names: list[str]) -> None:
    import tempfile

    import onnxruntime as ort

    print()
    print(
        "| model | O2 symbolic | O2 static | onnxruntime fp32 | symbolic / static | "
        "symbolic / onnxruntime | error symbolic (two sizes) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in names:
        with tempfile.TemporaryDirectory() as workdir:
            path = os.path.join(workdir, "model.onnx")
            kind = _export(name, path)
            options = ort.SessionOptions()
            options.intra_op_num_threads = 1
            session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            input_name, _, shape, other = _INPUTS[kind]
            builds = {}
            for label, shape_dict in (("symbolic", None), ("static", {input_name: shape})):
                mod, params = tvmamp.from_onnx(path, shape_dict=shape_dict)
                builds[label] = tvmamp.build(mod, "O2", "llvm", dtype="bfloat16", params=params)
            errors = []
            for size in (shape, other):
                x = _example(kind, size, numpy=True)
                want = session.run(None, {input_name: x})[0]
                errors.append(f"{max_rel_error(np.asarray(builds['symbolic'](x)), want):.1e}")
            x = _example(kind, shape, numpy=True)
            args = [tvm.runtime.tensor(x)]
            runs = [lambda exe=exe, args=args: exe.vm["main"](*args) for exe in builds.values()]
            feed = {input_name: x}
            runs.append(lambda session=session, feed=feed: session.run(None, feed))
            symbolic, static, onnxruntime = paired_medians(runs, repeat=repeat)
        print(
            f"| {name} {shape} | {symbolic * 1e3:.2f} ms | {static * 1e3:.2f} ms | "
            f"{onnxruntime * 1e3:.2f} ms | {symbolic / static:.2f} | "
            f"{symbolic / onnxruntime:.2f} | {', '.join(errors)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=int(os.environ.get("TVM_NUM_THREADS", 1)))
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument(
        "--sections", nargs="+", choices=["rows", "moe", "onnx"], default=["rows", "moe", "onnx"]
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=list(EXPORTS),
        default=[name for name, spec in EXPORTS.items() if spec[3] not in _TORCHVISION_KINDS],
        metavar="MODEL",
        help="the ONNX exports to run (default all but the torchvision/timm ones: "
        f"{', '.join(EXPORTS)})",
    )
    args = parser.parse_args()
    if os.environ.get("TVM_NUM_THREADS") != str(args.threads):
        parser.error(f"set TVM_NUM_THREADS={args.threads} (TVM reads it when it starts)")
    torch.set_num_threads(args.threads)
    if "rows" in args.sections:
        dynamic_rows(args.repeat)
    if "moe" in args.sections:
        mixture_of_experts(args.repeat)
    if "onnx" in args.sections:
        onnx_exports(args.repeat, args.models)


if __name__ == "__main__":
    main()
