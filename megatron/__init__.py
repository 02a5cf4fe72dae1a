"""megatron-tds: Megatron-style 3D-parallel pretraining of GPT-2 and T5.

``megatron`` is shared with megatron-core, whose wheel installs ``megatron/core/`` (and, in
some releases, more subpackages) without a ``megatron/__init__.py``: a namespace package.
This package is a regular one, which Python's import system takes over namespace portions
wherever they sit on ``sys.path``; ``pkgutil.extend_path`` then appends every other
``megatron/`` directory on ``sys.path`` to this package's ``__path__``, after this one. So
``import megatron.core`` finds megatron-core's while this project's modules (``megatron.mpu``,
``megatron.training``, ...) stay this project's, whichever was installed first.
"""
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

__version__ = "0.1.0"
