"""Weight quantization of an exported engine with ONNX Runtime's own quantizers."""

from __future__ import annotations

import shutil
from pathlib import Path

from edge_sd.errors import ExportError

# MatMulNBits, block 32, symmetric. Measured on SmolLM2-135M, 2 cores, ms per forward of 1 / 2 / 4
# tokens: int4 at accuracy level 4 (int8 activations) 15.9 / 17.0 / 20.9, at level 1 (fp32
# activations) 20.4 / 33.0 / 34.2; int8 at level 4 19.5 / 21.8 / 27.3; the fp32 engine 37 / 37 / 39.
# But level 4 makes a 4-token forward differ from 4 single steps by 1.3e-2 (relative to the logit
# scale), level 1 by 1.3e-6: a target must compute the same thing either way for speculative decoding
# to equal its plain decoding, so a target takes level 1 and a drafter level 4.
QUANT_BLOCK = 32
LEVEL_BATCH_CONSISTENT = 1
LEVEL_FAST = 4


def quantize(folder: Path, precision: str, batch_consistent: bool = True) -> None:
    """Replace folder/model.onnx (and its external data) by a weight-quantized model.

    batch_consistent: a k-token forward must equal k single steps (any engine that may be a target).
    """
    src = folder / "model.onnx"
    out_dir = folder / "quantized"
    out_dir.mkdir()
    out = out_dir / "model.onnx"
    try:
        if precision in ("int8", "int4"):
            import logging

            import onnx
            from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

            # The quantizer logs every node at INFO level; the progress line says enough.
            logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)

            # Weight-only (MatMulNBits). Dynamic int8 quantization (activations scaled per tensor) is
            # never used: it breaks batch consistency for targets and is slower for drafters.
            q = MatMulNBitsQuantizer(onnx.load(str(src)), bits=int(precision[3:]), block_size=QUANT_BLOCK,
                                     is_symmetric=True,
                                     accuracy_level=LEVEL_BATCH_CONSISTENT if batch_consistent else LEVEL_FAST)
            q.process()
            onnx.save_model(q.model.model, str(out), save_as_external_data=True,
                            location="model.onnx_data")
        else:
            raise ExportError(f"no quantizer for {precision}")
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(f"quantization to {precision} failed: {e}") from None
    for f in folder.glob("model.onnx*"):
        f.unlink()
    for f in out_dir.iterdir():
        f.chmod(0o644)  # onnx writes external data owner-only; the export is meant to be shared
        shutil.move(str(f), folder / f.name)
    out_dir.rmdir()
