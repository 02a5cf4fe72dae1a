"""tds pipeline parallelism: DeepSpeed's specs and topology, tds's PipelineModule with virtual
stages, and the schedules a training step calls (:mod:`.schedule_step`). Nothing here
imports megatron: the schedule machinery is generic."""
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, ProcessTopology

from .contract import StageContract, contract_of
from .module import PipelineModule
from .p2p import StageLink

__all__ = ["LayerSpec", "PipeModelDataParallelTopology", "PipelineModule", "ProcessTopology",
           "StageContract", "StageLink", "TiedLayerSpec", "contract_of"]
