#!/bin/bash
set -e
gcc -O2 -o /app/sum /app/sum.c
