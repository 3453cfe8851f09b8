"""Schedules for tvmamp: dlight rules and tensor intrinsics, one subpackage per target family.

- :mod:`tvmamp.schedules.cpu`: CPU rules (matmul in fp32/bf16/fp16, conv2d, injective ops),
  the bf16 tuning space and the weight-packing pass;
- :mod:`tvmamp.schedules.x86`: the ``vdpbf16ps``, AMX and F16C intrinsics the CPU rules use;
- :mod:`tvmamp.schedules.cuda`: the mma.sync tensor-core rule, its intrinsics, the default rules;
- :mod:`tvmamp.schedules.guard`: ``Guarded``, which turns a rule's failure into "does not apply";
- :mod:`tvmamp.schedules.intrin_loader`: registers only one family of TVM's tensor intrinsics.

Nothing is imported here, so a target entry can import one family without the others.
"""
