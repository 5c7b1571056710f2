"""Test-only helpers, imported by the tests as ``support.<module>`` (pytest puts ``tests/`` on
``sys.path``).  Nothing here is part of hybridkv's public API.

* :mod:`support.toy_cache`        :class:`ToyCache`, a small reference allocator
* :mod:`support.paged_generator`  :class:`PagedGenerator`, a minimal decoding loop over the
  runner without the scheduler, driving a ToyCache or a :class:`ManagerCache`
* :mod:`support.manager_cache`    :class:`ManagerCache`: the real cache manager behind the
  ToyCache interface
* :mod:`support.reference`        transformers' greedy decoding, whole-prompt and chunked: the
  oracles the paged runner must reproduce
"""
