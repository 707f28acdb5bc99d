"""The run server's first import (:data:`medfed.compare.runner.RUN_SERVER_PRELOAD`): the server dies with compare.

compare's run server is ``multiprocessing``'s forkserver, a process of its
own that imported torch, Lightning and MONAI once and forks each run. Its
own way out when compare ends (the EOF of its "alive" pipe) runs the
interpreter's finalisation, which takes seconds with those libraries loaded
(6 s on a loaded 2-core VM). Importing this module in the server makes the
kernel kill it the moment compare ends, however it ends (``kill -9``
included): :func:`~medfed.compare.runner.die_with_parent`. Only the server
imports it.
"""

from medfed.compare.runner import die_with_parent

die_with_parent()
