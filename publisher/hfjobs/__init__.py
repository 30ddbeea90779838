"""Run the publish on Hugging Face Jobs: `hf-ao-publish MODEL --quant RECIPE --on-hf-jobs FLAVOR`.

remote.py     the command: local preflight, ship the code, one job per recipe, follow them; --attach
many.py       several models at once: one request per model, one preflight of all, one table or JSON list
preflight.py  flavor against recipes, and the token's right to start Jobs, before anything is submitted
hardware.py   the flavors on offer: the Hub's list, else the built-in table (publisher/flavors.py)
package.py    a reproducible wheel of the running code, uploaded to a private Hub repo for the job
bootstrap.py  what the job runs (stdlib only): install that wheel and torch, run the CLI, report the result
follow.py     stream the jobs' logs, read their results back, cancel on Ctrl-C
"""
