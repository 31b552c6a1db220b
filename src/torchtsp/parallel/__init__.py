from .api import parallelize
from .pipeline import pipeline_parallelize

__all__ = ["parallelize", "pipeline_parallelize"]
