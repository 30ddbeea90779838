"""Pipeline stages, one module each, in run order: source, plan, preflight, fetch, quantize (with resume),
then verification (publisher.verify), sample and measure, card, push (or lowdisk_push: through a checked pull request).
"""
