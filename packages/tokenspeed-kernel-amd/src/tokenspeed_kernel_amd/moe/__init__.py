"""Gluon MoE kernels for CDNA3/CDNA4: tiny-batch GEMVs and grouped GEMMs over MXFP4 weights."""
