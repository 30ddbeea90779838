"""Process-level runtime helpers of a command: how it logs, how it ends on a signal, how its children are run.

logs.py     our messages and the libraries' warnings on stderr, known-harmless noise dropped
progress.py progress bars only on a terminal, never with --quiet (ours and the libraries')
signals.py  SIGINT and SIGTERM raise errors.Interrupted in the main thread
procs.py    child processes in their own process group, killed with it when we stop waiting
zygote.py   run as a script: an interpreter that has imported torch (and what else it is told) forks a child per script
zygotes.py  scripts run forked from a zygote of their interpreter where there is one, else in a fresh one
gcfreeze.py the cyclic garbage collector paused while the libraries are imported, their objects frozen after
patches.py  attributes of a library replaced while a holder is inside, re-entrant, put back by the last one
"""
