"""tds pipeline parallelism: DeepSpeed's specs, its PipelineModule with virtual stages,
tds's engine."""
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, ProcessTopology
# the partition PipelineModule applies, for code that predicts a stage's layers
from deepspeed.runtime.utils import partition_balanced, partition_uniform

from .contract import StageContract, contract_of
from .engine import PipelineEngine
from .module import PipelineModule

__all__ = ["LayerSpec", "PipelineEngine", "PipelineModule", "PipeModelDataParallelTopology",
           "ProcessTopology", "StageContract", "TiedLayerSpec", "contract_of",
           "partition_balanced", "partition_uniform"]
