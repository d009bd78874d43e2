"""A rank: what each forked rank runs (``torchrun --run-path`` of this file, see
:mod:`ppoflow.infra.remote.rank.launch`), the rank entry's ``main``."""

from ppoflow.infra.remote.rank.entry import main

main()
