"""MPI through Ray, without SSH: mpirun on node 0 starts its daemons on the other nodes through their
node actors (`rsh`, OpenMPI's `plm_rsh_agent`); `launch` builds the hostfile, the mpirun command and
the gang launch."""
