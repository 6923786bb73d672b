#!/bin/bash
tr '[:lower:]' '[:upper:]' < /app/secret.txt > /app/answer.txt
