"""Hub and file I/O, the bottom layer: everything else reads and writes the Hub and local files through these.

hub.py         one HfApi per run (per token), bounded retries with backoff, URL and delete helpers
downloads.py   downloads from the Hub checked against the Hub's own hashes before anything reads them
integrity.py   the hashes the Hub reports for a commit's files, and the checks against them
xetupload.py   Xet uploads of byte streams, and the bounds on hf_xet's download buffers
tokens.py      what a Hub token may do, read from whoami-v2
localfiles.py  reading local folders we do not own without being led outside them
jsonfile.py    the one reader for the JSON files the tool parses
keptfile.py    a JSON file of entries kept for a while beside a cache, expired by age, replaced whole
"""
