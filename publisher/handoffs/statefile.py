"""The state file's name: the record in every published repo of what produced it (publisher/state.py builds it).

A re-run reads it to detect "nothing changed"; `verify TARGET` reads it for the recipe.
"""

STATE_FILE = "hf_ao_publish.json"
