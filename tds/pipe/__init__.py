"""tds pipeline parallelism: DeepSpeed's specs and topology, tds's PipelineModule with virtual
stages, and the schedules a training step calls (:mod:`.schedule_step`). Nothing here
imports megatron: the schedule machinery is generic."""
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, ProcessTopology
# the partition PipelineModule applies, for code that predicts a stage's layers
from deepspeed.runtime.utils import partition_balanced, partition_uniform

from .contract import StageContract, contract_of
from .module import PipelineModule
from .p2p import StageLink

__all__ = ["LayerSpec", "PipeModelDataParallelTopology", "PipelineModule", "ProcessTopology",
           "StageContract", "StageLink", "TiedLayerSpec", "contract_of", "partition_balanced",
           "partition_uniform"]
