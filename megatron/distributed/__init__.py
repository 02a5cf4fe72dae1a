"""The gradient path of every layout: buffers, buckets and their data-parallel reduction
(:mod:`.data_parallel`, :mod:`.grad_buffer`)."""
from .data_parallel import DataParallel, DDPConfig, autocast_region, is_expert, tied_weights_of
from .grad_buffer import Bucket, GradBuffer

__all__ = ["Bucket", "DDPConfig", "DataParallel", "GradBuffer", "autocast_region", "is_expert",
           "tied_weights_of"]
