"""How the launcher reaches other machines: ssh sessions over paramiko (:mod:`.ssh`) and the
working-directory sync that rides on them (:mod:`.sync`). Used by the ssh backend and by
``pslaunch doctor``."""
