"""specdec.zoo: a small, reproducible model family trained on the spot from the Python sources
every machine has (a target and drafters that really agree), for experiments without a hub."""

from .build import Zoo, build, build_dir, load, zoo_root
from .presets import PRESETS, Recipe, get_recipe

__all__ = ["Zoo", "build", "build_dir", "load", "zoo_root", "PRESETS", "Recipe", "get_recipe"]
