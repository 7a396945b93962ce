"""humming.schema stand-in (see humming/__init__.py)."""

from humming._absent import absent_module_getattr

__getattr__ = absent_module_getattr(__name__)
