"""Small random ONNX stand-ins for `campplus.onnx` and `speech_tokenizer_v2.onnx`.

Design notes: docs/model.md.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

OPSET = 17  # no Gelu op before opset 20: GELU is written with Erf
IR_VERSION = 8  # readable by onnxruntime >= 1.10

CAMPPLUS_IN_MELS = 80
CAMPPLUS_HIDDEN = 64
SPK_EMBED_DIM = 192
TOKENIZER_IN_MELS = 128
TOKENIZER_CHANNELS = 32
FSQ_DIGITS = 8  # 3^8 = 6561 speech tokens
FSQ_SCALE = 0.999


def _normal(gen: torch.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * std).to(torch.float32).numpy()


def _const(name: str, value: np.ndarray | float | list[int], dtype: type = np.float32) -> onnx.NodeProto:
    arr = np.asarray(value, dtype=dtype)
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(arr, name))


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="cosyvoice2-studio make_model")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def _gelu(x: str, out: str, nodes: list[onnx.NodeProto]) -> None:
    """Exact GELU: out = 0.5 x (1 + erf(x / sqrt 2))."""
    nodes += [
        _const(f"{out}_rsqrt2", 1.0 / math.sqrt(2.0)),
        helper.make_node("Mul", [x, f"{out}_rsqrt2"], [f"{out}_s"]),
        helper.make_node("Erf", [f"{out}_s"], [f"{out}_erf"]),
        _const(f"{out}_one", 1.0),
        helper.make_node("Add", [f"{out}_erf", f"{out}_one"], [f"{out}_p"]),
        _const(f"{out}_half", 0.5),
        helper.make_node("Mul", [x, f"{out}_half"], [f"{out}_hx"]),
        helper.make_node("Mul", [f"{out}_hx", f"{out}_p"], [out]),
    ]


def build_campplus(seed: int = 0) -> onnx.ModelProto:
    """The CAM++ stand-in: `input` float32 [1, T, 80] -> `output` float32 [1, 192]."""
    gen = torch.Generator().manual_seed(seed)
    w1 = _normal(gen, (CAMPPLUS_IN_MELS, CAMPPLUS_HIDDEN), 1.0 / math.sqrt(CAMPPLUS_IN_MELS))  # x @ w1
    b1 = _normal(gen, (CAMPPLUS_HIDDEN,), 0.05)
    w2 = _normal(gen, (SPK_EMBED_DIM, 2 * CAMPPLUS_HIDDEN), 1.0 / math.sqrt(2 * CAMPPLUS_HIDDEN))
    b2 = _normal(gen, (SPK_EMBED_DIM,), 0.05)
    inits = [numpy_helper.from_array(a, n) for a, n in ((w1, "proj.weight"), (b1, "proj.bias"),
                                                        (w2, "out.weight"), (b2, "out.bias"))]
    nodes = [
        _const("in_scale", 0.25),  # fbank values are ~±10: keep tanh out of saturation
        helper.make_node("Mul", ["input", "in_scale"], ["x"]),  # [1, T, 80]
        helper.make_node("MatMul", ["x", "proj.weight"], ["xw"]),  # [1, T, 64]
        helper.make_node("Add", ["xw", "proj.bias"], ["xwb"]),
        helper.make_node("Tanh", ["xwb"], ["h"]),
        helper.make_node("ReduceMean", ["h"], ["h_mean"], axes=[1], keepdims=0),  # [1, 64]
        helper.make_node("Mul", ["h", "h"], ["h2"]),
        helper.make_node("ReduceMean", ["h2"], ["h2_mean"], axes=[1], keepdims=0),  # [1, 64]
        helper.make_node("Concat", ["h_mean", "h2_mean"], ["stats"], axis=-1),  # [1, 128]
        helper.make_node("Gemm", ["stats", "out.weight", "out.bias"], ["output"], transB=1),  # [1, 192]
    ]
    graph = helper.make_graph(
        nodes, "campplus_standin",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", CAMPPLUS_IN_MELS])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, SPK_EMBED_DIM])],
        inits,
    )
    return _model(graph)


def _standardise_fsq(x: str, out: str, nodes: list[onnx.NodeProto]) -> None:
    """Append nodes: `x` [1, 32, T'] standardised per channel over time, projected to 8 digits and
    quantised (FSQ, ternary) -> `out` [1, T'] int64 token indices."""
    nodes += [
        # per-channel standardisation over time
        helper.make_node("ReduceMean", [x], ["mu"], axes=[2], keepdims=1),  # [1, 32, 1]
        helper.make_node("Sub", [x, "mu"], ["centred"]),
        helper.make_node("Mul", ["centred", "centred"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["var"], axes=[2], keepdims=1),
        _const("eps", 1e-5),
        helper.make_node("Add", ["var", "eps"], ["var_eps"]),
        helper.make_node("Sqrt", ["var_eps"], ["std"]),
        helper.make_node("Div", ["centred", "std"], ["z"]),  # [1, 32, T']
        helper.make_node("Transpose", ["z"], ["zt"], perm=[0, 2, 1]),  # [1, T', 32]
        helper.make_node("MatMul", ["zt", "proj.weight"], ["p"]),  # [1, T', 8]
        helper.make_node("Add", ["p", "proj.bias"], ["pb"]),
        # FSQ: 8 ternary digits
        helper.make_node("Tanh", ["pb"], ["t"]),
        _const("fsq_scale", FSQ_SCALE),
        helper.make_node("Mul", ["t", "fsq_scale"], ["ts"]),
        helper.make_node("Round", ["ts"], ["r"]),  # {-1, 0, 1}
        _const("digit_offset", 1.0),
        helper.make_node("Add", ["r", "digit_offset"], ["digits"]),  # {0, 1, 2}
        helper.make_node("Mul", ["digits", "powers"], ["weighted"]),
        _const("sum_axes", [2], np.int64),
        helper.make_node("ReduceSum", ["weighted", "sum_axes"], ["index_f"], keepdims=0),  # [1, T']
        helper.make_node("Cast", ["index_f"], [out], to=TensorProto.INT64),
    ]


def build_speech_tokenizer(seed: int = 0) -> onnx.ModelProto:
    """The S3Tokenizer-v2 stand-in: `feats` [1,128,T] f32, `feats_length` [1] i32 -> `indices` [1,T'] i64."""
    gen = torch.Generator().manual_seed(seed)
    c = TOKENIZER_CHANNELS
    arrays = {
        "conv1.weight": _normal(gen, (c, TOKENIZER_IN_MELS, 3), 1.0 / math.sqrt(3 * TOKENIZER_IN_MELS)),
        "conv1.bias": _normal(gen, (c,), 0.05),
        "conv2.weight": _normal(gen, (c, c, 3), 1.0 / math.sqrt(3 * c)),
        "conv2.bias": _normal(gen, (c,), 0.05),
        "proj.weight": _normal(gen, (c, FSQ_DIGITS), 1.0 / math.sqrt(c)),  # y @ w
        "proj.bias": _normal(gen, (FSQ_DIGITS,), 0.05),
        "powers": np.array([3.0**i for i in range(FSQ_DIGITS)], dtype=np.float32),  # [8]
    }
    inits = [numpy_helper.from_array(a, n) for n, a in arrays.items()]
    conv = {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}
    nodes = [
        # valid-frame mask: arange(T) < feats_length -> [T], broadcast over [1, 128, T]
        helper.make_node("Shape", ["feats"], ["feats_shape"]),
        _const("axis_t", 2, np.int64),
        helper.make_node("Gather", ["feats_shape", "axis_t"], ["n_frames"], axis=0),  # scalar
        _const("zero_i64", 0, np.int64),
        _const("one_i64", 1, np.int64),
        helper.make_node("Range", ["zero_i64", "n_frames", "one_i64"], ["frame_idx"]),  # [T]
        helper.make_node("Cast", ["feats_length"], ["length_i64"], to=TensorProto.INT64),  # [1]
        helper.make_node("Less", ["frame_idx", "length_i64"], ["valid"]),
        helper.make_node("Cast", ["valid"], ["valid_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["feats", "valid_f"], ["x0"]),  # [1, 128, T]
        helper.make_node("Conv", ["x0", "conv1.weight", "conv1.bias"], ["c1"], **conv),  # [1, 32, ceil(T/2)]
    ]
    _gelu("c1", "g1", nodes)
    nodes.append(helper.make_node("Conv", ["g1", "conv2.weight", "conv2.bias"], ["c2"], **conv))  # [1,32,T']
    _gelu("c2", "g2", nodes)
    _standardise_fsq("g2", "indices", nodes)
    graph = helper.make_graph(
        nodes, "speech_tokenizer_v2_standin",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, TOKENIZER_IN_MELS, "T"]),
         helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1])],
        [helper.make_tensor_value_info("indices", TensorProto.INT64, [1, "T_tok"])],
        inits,
    )
    return _model(graph)


def write_campplus(path: str | Path, seed: int = 0) -> Path:
    """Write the CAM++ stand-in to `path` (e.g. `<model>/campplus.onnx`)."""
    path = Path(path)
    onnx.save_model(build_campplus(seed), path)
    return path


def write_speech_tokenizer(path: str | Path, seed: int = 0) -> Path:
    """Write the speech-tokenizer stand-in to `path` (e.g. `<model>/speech_tokenizer_v2.onnx`)."""
    path = Path(path)
    onnx.save_model(build_speech_tokenizer(seed), path)
    return path
