from .api import SCHEME_CLASSES, parallelize
from .pipeline import pipeline_parallelize

__all__ = ["SCHEME_CLASSES", "parallelize", "pipeline_parallelize"]
