"""The library under the scripts (DESIGN.md, "Layers and imports"): what train.py, capture.py, export.py,
evaluate.py and gate.py share above models/, kernels/ and data/."""
