from .api import SCHEME_CLASSES, parallelize

__all__ = ["SCHEME_CLASSES", "parallelize"]
