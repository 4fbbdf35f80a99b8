"""hetjax: train one LLM across islands of mixed GPU vendors."""

import os as _os

__version__ = "0.1.0"

# Installed, hetjax.models, hetjax.configs and hetjax.launch are folders of this package
# (pyproject.toml's package-dir). In a checkout they sit beside it, at the repository's top
# level, so a checkout run without installing it (PYTHONPATH=.) looks for them there.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if (not _os.path.isdir(_os.path.join(__path__[0], "models"))
        and _os.path.isfile(_os.path.join(_checkout, "models", "__init__.py"))):
    __path__.append(_checkout)
