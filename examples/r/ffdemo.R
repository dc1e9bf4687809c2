# R on remote memory with the unmodified `ff` package (Remote Regions paper §8.6).
#
#   Rscript ffdemo.R generate DIR ROWS COLS SEED
#       writes a data set of COLS columns x ROWS rows of doubles as an ffdf,
#       one ff file per column (DIR/c01.ff ...), from the random seed SEED.
#       Column 11 is the response of the regression: 1*c12 + 2*c13 + ... +
#       9*c20 + N(0,1) noise; the other columns are N(0,1).
#
#   Rscript ffdemo.R run WORKLOAD DIR ROWS COLS OUT
#       opens DIR read-only as an ffdf and times one run of WORKLOAD:
#       R-Agg (mean over columns 1-10, chunk by chunk) or R-LR (lm of c11 on
#       c12..c20); saves time and result to OUT. One fresh R process per run,
#       so that no run inherits another's heap (the first big lm in an R
#       process pays for growing it, which skews whichever copy goes first).
#
#   Rscript ffdemo.R compare DIR ROUNDS
#       prints the times of DIR/<round>-<workload>-<tmpfs|regions>.rds and
#       their ratios, and fails unless every regions result equals the tmpfs
#       one within floating-point tolerance and R-LR finds the coefficients
#       1..9.
#
# Sections are 128 KiB wide (options(ffpagesize)), as in the paper.

suppressPackageStartupMessages(library(ff))
options(ffpagesize = 131072)

die <- function(...) {
  message("ffdemo: ", ...)
  quit(status = 1)
}

args <- commandArgs(trailingOnly = TRUE)
if (length(args) < 1) die("usage: generate DIR ROWS COLS SEED | run R-Agg|R-LR DIR ROWS COLS OUT | compare DIR ROUNDS")

col_name <- function(j) sprintf("c%02d", j)
col_file <- function(dir, j) file.path(dir, paste0(col_name(j), ".ff"))
agg_cols <- 1:10
lr_y <- 11
lr_x <- 12:20
beta <- seq_along(lr_x)

generate <- function(dir, n, ncols, seed) {
  if (ncols < max(lr_x)) die("need at least ", max(lr_x), " columns")
  set.seed(seed)
  y <- numeric(n)
  cols <- list()
  # Progress on a terminal only: a log or a pipe gets no carriage returns.
  progress <- function(done) {
    if (isatty(stdout())) cat(sprintf("\r   %d of %d columns written (%d MiB)", done, ncols, done * n * 8 %/% 1048576))
  }
  for (j in seq_len(ncols)) {
    if (j == lr_y) next
    v <- rnorm(n)
    if (j %in% lr_x) y <- y + beta[j - min(lr_x) + 1] * v
    cols[[col_name(j)]] <- ff(initdata = v, vmode = "double", filename = col_file(dir, j), overwrite = TRUE)
    progress(length(cols))
  }
  cols[[col_name(lr_y)]] <- ff(initdata = y + rnorm(n), vmode = "double", filename = col_file(dir, lr_y), overwrite = TRUE)
  progress(length(cols))
  if (isatty(stdout())) cat("\n")
  cols <- cols[col_name(seq_len(ncols))]
  df <- do.call(ffdf, cols)
  cat(sprintf("generated an ffdf of %d rows x %d columns (%.0f MiB) in %s\n",
              nrow(df), ncol(df), nrow(df) * ncol(df) * 8 / 2^20, dir))
  for (x in cols) close(x)
}

open_ffdf <- function(dir, n, ncols) {
  cols <- lapply(seq_len(ncols), function(j) {
    f <- col_file(dir, j)
    if (!file.exists(f)) die("missing column file ", f)
    x <- ff(vmode = "double", filename = f, readonly = TRUE)
    if (length(x) != n) die(f, " holds ", length(x), " rows, expected ", n)
    x
  })
  names(cols) <- col_name(seq_len(ncols))
  do.call(ffdf, cols)
}

# R-Agg: the mean of each of ten columns, read chunk by chunk.
r_agg <- function(df) {
  vapply(col_name(agg_cols), function(name) {
    x <- df[[name]]
    s <- 0
    for (i in chunk(x)) s <- s + sum(x[i])
    s / length(x)
  }, numeric(1))
}

# R-LR: a linear regression over ten columns.
r_lr <- function(df) {
  d <- df[, col_name(c(lr_y, lr_x))]
  coef(lm(as.formula(paste(col_name(lr_y), "~ .")), data = d))
}

workloads <- list("R-Agg" = r_agg, "R-LR" = r_lr)

# One timed run of one workload in this (fresh) R process; saves the time
# and the result to OUT for `compare`.
run_one <- function(workload, dir, n, ncols, out) {
  f <- workloads[[workload]]
  if (is.null(f)) die("unknown workload ", workload, " (R-Agg or R-LR)")
  df <- open_ffdf(dir, n, ncols)
  invisible(lm(y ~ x, data.frame(x = rnorm(1000), y = rnorm(1000))))
  gc(verbose = FALSE)
  time <- system.time(result <- f(df))[["elapsed"]]
  saveRDS(list(time = time, result = result), out)
  cat(sprintf("   %-22s %6.3f s\n", sub("[.]rds$", "", basename(out)), time))
}

# Reads DIR/<round>-<workload>-<tmpfs|regions>.rds, prints times and ratios,
# fails unless every regions result equals the tmpfs one.
compare <- function(dir, rounds) {
  cat(sprintf("R-Agg: mean over %d columns; R-LR: lm of one column on %d others\n",
              length(agg_cols), length(lr_x)))
  cat(sprintf("%-6s %-8s %-5s %10s %10s %7s\n", "round", "workload", "", "tmpfs s", "regions s", "ratio"))
  ok <- TRUE
  worst <- 0
  summary <- character()
  for (round in seq_len(rounds)) {
    state <- if (round == 1) "cold" else "warm"
    for (w in names(workloads)) {
      t <- readRDS(file.path(dir, sprintf("%d-%s-tmpfs.rds", round, w)))
      r <- readRDS(file.path(dir, sprintf("%d-%s-regions.rds", round, w)))
      worst <- max(worst, abs(r$result - t$result) / pmax(abs(t$result), 1e-300))
      if (!isTRUE(all.equal(r$result, t$result, tolerance = 1e-9))) {
        ok <- FALSE
        message("ffdemo: ", w, " on regions differs from tmpfs: ", paste(format(r$result), collapse = " "),
                " vs ", paste(format(t$result), collapse = " "))
      }
      if (w == "R-LR" && any(abs(unname(t$result[-1]) - beta) > 0.05)) {
        ok <- FALSE
        message("ffdemo: R-LR coefficients ", paste(format(t$result[-1]), collapse = " "), " are not 1..9")
      }
      ratio <- r$time / max(t$time, 1e-9)
      summary <- c(summary, sprintf("%s-%s %.3f %.3f %.3f", w, state, t$time, r$time, ratio))
      cat(sprintf("%-6d %-8s %-5s %10.3f %10.3f %7.3f\n", round, w, state, t$time, r$time, ratio))
    }
  }
  agg <- readRDS(file.path(dir, sprintf("%d-R-Agg-regions.rds", rounds)))$result
  lr <- readRDS(file.path(dir, sprintf("%d-R-LR-regions.rds", rounds)))$result
  cat(sprintf("R-Agg means (regions): %s\n", paste(sprintf("%.5f", agg), collapse = " ")))
  cat(sprintf("R-LR coefficients (regions): %s\n", paste(sprintf("%.4f", lr), collapse = " ")))
  cat(sprintf("results equal to tmpfs: %s (largest relative difference %.3g)\n", if (ok) "yes" else "NO", worst))
  for (s in summary) cat("summary", s, "\n")
  if (!ok) quit(status = 1)
}

mode <- args[[1]]
if (mode == "generate" && length(args) == 5) {
  generate(args[[2]], as.integer(args[[3]]), as.integer(args[[4]]), as.integer(args[[5]]))
} else if (mode == "run" && length(args) == 6) {
  run_one(args[[2]], args[[3]], as.integer(args[[4]]), as.integer(args[[5]]), args[[6]])
} else if (mode == "compare" && length(args) == 3) {
  compare(args[[2]], as.integer(args[[3]]))
} else {
  die("usage: generate DIR ROWS COLS SEED | run R-Agg|R-LR DIR ROWS COLS OUT | compare DIR ROUNDS")
}
