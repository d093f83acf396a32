"""Making EAGLE heads: committed distilled replies (and, later, features and training).

Nothing here is imported by the serving plugin; it needs torch and transformers, not vLLM.
"""
