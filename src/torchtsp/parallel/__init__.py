from .api import SCHEMES, parallelize

__all__ = ["SCHEMES", "parallelize"]
