"""medfed: personalised federated learning for multi-hospital medical imaging.

The flagship method is pFedNet (shared + personal model components linked by a
similarity network of sites); its peers and baselines run in the same harness.
"""

__version__ = "0.1.0"
