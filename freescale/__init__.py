"""FreeScale: bubble-free distributed training of sequence recommendation models.

Importing this package is cheap by design: it initializes no CUDA context, no
process group and does not import Triton. Import the subpackages you need.
"""

__version__ = "0.1.0"
