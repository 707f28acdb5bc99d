"""The numerical solvers of particular strategies, kept apart from the framework (loop, site, link, executor).

- :mod:`.graph`: the similarity network between sites (pFedNet, FPFC),
- :mod:`.sketch`: the data and feature sketches pFedNet's graph is built from,
- :mod:`.network_lasso`: pFedNet's ADMM solver of the network lasso over that graph,
- :mod:`.fusion`: pFedNet's fusion threshold (the scale of its penalty strength),
- :mod:`.concave_penalty`: FPFC's SCAD/MCP pairwise fusion penalty and its proximal step.
"""
