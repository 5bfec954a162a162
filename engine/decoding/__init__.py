"""The decoding rules: the draft-and-edit threshold step (LLaDA2.0/2.1), the Levenshtein step (LLaDA2.2), logit controls, grammar constraints, the denoise trace."""
