import os
import tempfile

# Generated checkpoints (strata-tiny) go to a per-run home unless the caller chose one, so tests never
# depend on, or write to, the user's cache.
os.environ.setdefault("STRATA_HOME", os.path.join(tempfile.gettempdir(), f"strata-test-home-{os.getuid()}"))
