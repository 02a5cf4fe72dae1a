"""tds pipeline parallelism: DeepSpeed's PipelineModule and specs, tds's engine."""
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, ProcessTopology

from .contract import StageContract, contract_of
from .engine import PipelineEngine

__all__ = ["LayerSpec", "PipelineEngine", "PipelineModule", "PipeModelDataParallelTopology",
           "ProcessTopology", "StageContract", "TiedLayerSpec", "contract_of"]
