"""edge-sd: lossless speculative decoding across vocabularies, on a lean ONNX Runtime runtime.

The runtime (this package minus `edge_sd.export`) imports numpy, onnxruntime and tokenizers only.
"""

__version__ = "0.2.0"

from edge_sd.config import GenerationConfig, GenerationResult  # noqa: E402
from edge_sd.errors import EdgeSDError  # noqa: E402
from edge_sd.generator import Generator  # noqa: E402
from edge_sd.model import Model  # noqa: E402
from edge_sd.pipeline import Pipeline  # noqa: E402

__all__ = ["EdgeSDError", "GenerationConfig", "GenerationResult", "Generator", "Model", "Pipeline", "__version__"]
