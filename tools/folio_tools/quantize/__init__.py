"""Offline quantizers (a tool): `folio quantize` turns a 16/32-bit model into an int8, int4, GPTQ, AWQ or
NF4 checkpoint. The formats those checkpoints load into at run time live in folio/weight_formats/."""
