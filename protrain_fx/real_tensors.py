"""real_tensors(): run real work from inside AOTAutograd's partitioner, where the backend profiles, measures and builds.

The partitioner runs under AOTAutograd's fake mode and with the Python dispatcher on. Real tensors need the
fake mode off; and a collective issued with the Python dispatcher on keeps the GIL while gloo's worker thread
may need it to finish the previous collective, a deadlock seen in two-rank runs. Inside `real_tensors()` both are off,
as in any eager PyTorch program.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch._dispatch.python import no_python_dispatcher
from torch._subclasses.fake_tensor import unset_fake_temporarily


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    with unset_fake_temporarily(), no_python_dispatcher():
        yield
