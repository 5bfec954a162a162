"""Transitional alias of engine/model_path.py: engine/core.py still imports resolve_model_path from here.
Delete this file once that import names redraft.engine.model_path."""

from redraft.engine.model_path import BUNDLED_MODEL_DIR, default_model_path, resolve_model_path  # noqa: F401
