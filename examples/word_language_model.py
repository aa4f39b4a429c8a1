# A word-level LSTM language model written the way pytorch/examples' word_language_model/main.py
# is written (argparse, --accel through torch.accelerator, batchify/get_batch/repackage_hidden,
# torch.save(model, f) of the best model and torch.load(f) for the final test), on a small
# synthetic corpus so that it runs anywhere in seconds.
#
# It never imports deferfuse: with deferfuse installed, `import torch` registers the tpu device
# (the torch.backends entry point), torch.accelerator.current_accelerator() is tpu, and
#     python examples/word_language_model.py --accel
# trains, saves, reloads and tests on tpu. Without --accel it runs on CPU.
import argparse
import math
import random
import time

import torch
import torch.nn as nn

parser = argparse.ArgumentParser(description="LSTM/GRU language model on a synthetic corpus")
parser.add_argument("--model", type=str, default="LSTM", help="type of recurrent net (LSTM, GRU)")
parser.add_argument("--emsize", type=int, default=32, help="size of word embeddings")
parser.add_argument("--nhid", type=int, default=32, help="number of hidden units per layer")
parser.add_argument("--nlayers", type=int, default=2, help="number of layers")
parser.add_argument("--lr", type=float, default=20, help="initial learning rate")
parser.add_argument("--clip", type=float, default=0.25, help="gradient clipping")
parser.add_argument("--epochs", type=int, default=3, help="upper epoch limit")
parser.add_argument("--batch_size", type=int, default=16, metavar="N", help="batch size")
parser.add_argument("--bptt", type=int, default=20, help="sequence length")
parser.add_argument("--dropout", type=float, default=0.2, help="dropout applied to layers (0 = no dropout)")
parser.add_argument("--tied", action="store_true", help="tie the word embedding and softmax weights")
parser.add_argument("--seed", type=int, default=1111, help="random seed")
parser.add_argument("--log-interval", type=int, default=5, metavar="N", help="report interval")
parser.add_argument("--save", type=str, default="model.pt", help="path to save the final model")
parser.add_argument("--words", type=int, default=6000, help="tokens in the synthetic training text")
parser.add_argument("--dry-run", action="store_true", help="verify the code and the model")
parser.add_argument("--accel", action="store_true", help="Enables accelerated training")
args = parser.parse_args()

# Set the random seed manually for reproducibility.
torch.manual_seed(args.seed)

if args.accel and torch.accelerator.is_available():
    device = torch.accelerator.current_accelerator()
else:
    device = torch.device("cpu")

print("Using device:", device)

###############################################################################
# Load data: a synthetic corpus (a random grammar of a few dozen words)
###############################################################################


class Dictionary:
    def __init__(self):
        self.word2idx = {}
        self.idx2word = []

    def add_word(self, word):
        if word not in self.word2idx:
            self.idx2word.append(word)
            self.word2idx[word] = len(self.idx2word) - 1
        return self.word2idx[word]

    def __len__(self):
        return len(self.idx2word)


class SyntheticCorpus:
    """Sentences from a small grammar; each word's successor depends on it, so there is
    something to learn. Python's own generator, seeded: the same text on every machine."""

    def __init__(self, n_words, seed):
        rng = random.Random(seed)
        subjects = ["the cat", "a dog", "my friend", "the old man", "a bird", "the teacher"]
        verbs = ["sees", "likes", "finds", "follows", "draws", "hears"]
        objects = ["the house", "a tree", "the river", "a small box", "the red car", "an apple"]
        endings = ["today", "at night", "again", "in the rain", "slowly", "with care"]
        self.dictionary = Dictionary()
        for part in subjects + verbs + objects + endings + ["<eos>"]:
            for w in part.split():
                self.dictionary.add_word(w)

        def text(n):
            words = []
            while len(words) < n:
                sentence = [rng.choice(subjects), rng.choice(verbs), rng.choice(objects)]
                if rng.random() < 0.5:
                    sentence.append(rng.choice(endings))
                words += " ".join(sentence).split() + ["<eos>"]
            return torch.tensor([self.dictionary.word2idx[w] for w in words[:n]], dtype=torch.int64)

        self.train = text(n_words)
        self.valid = text(n_words // 6)
        self.test = text(n_words // 6)


corpus = SyntheticCorpus(args.words, args.seed)


def batchify(data, bsz):
    # Work out how cleanly we can divide the dataset into bsz parts.
    nbatch = data.size(0) // bsz
    # Trim off any extra elements that wouldn't cleanly fit (remainders).
    data = data.narrow(0, 0, nbatch * bsz)
    # Evenly divide the data across the bsz batches.
    data = data.view(bsz, -1).t().contiguous()
    return data.to(device)


eval_batch_size = 10
train_data = batchify(corpus.train, args.batch_size)
val_data = batchify(corpus.valid, eval_batch_size)
test_data = batchify(corpus.test, eval_batch_size)

###############################################################################
# Build the model
###############################################################################


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.5, tie_weights=False):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            if nhid != ninp:
                raise ValueError("When using the tied flag, nhid must be equal to emsize")
            self.decoder.weight = self.encoder.weight
        self.rnn_type = rnn_type
        self.nhid = nhid
        self.nlayers = nlayers
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return torch.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                    weight.new_zeros(self.nlayers, bsz, self.nhid))
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


ntokens = len(corpus.dictionary)
model = RNNModel(args.model, ntokens, args.emsize, args.nhid, args.nlayers, args.dropout,
                 args.tied).to(device)
criterion = nn.NLLLoss()

###############################################################################
# Training code
###############################################################################


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


def evaluate(data_source):
    # Turn on evaluation mode which disables dropout.
    model.eval()
    total_loss = 0.
    hidden = model.init_hidden(eval_batch_size)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)


def train():
    # Turn on training mode which enables dropout.
    model.train()
    total_loss = 0.
    start_time = time.time()
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = get_batch(train_data, i)
        # Starting each batch, we detach the hidden state from how it was previously produced.
        # If we didn't, the model would try backpropagating all the way to start of the dataset.
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()

        # `clip_grad_norm_` helps prevent the exploding gradient problem in RNNs / LSTMs.
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)

        total_loss += loss.item()

        if batch % args.log_interval == 0 and batch > 0:
            cur_loss = total_loss / args.log_interval
            elapsed = time.time() - start_time
            print("| epoch {:3d} | {:5d}/{:5d} batches | lr {:02.2f} | ms/batch {:5.2f} | "
                  "loss {:5.2f} | ppl {:8.2f}".format(
                      epoch, batch, len(train_data) // args.bptt, lr,
                      elapsed * 1000 / args.log_interval, cur_loss, math.exp(cur_loss)))
            total_loss = 0
            start_time = time.time()
        if args.dry_run:
            break


# Loop over epochs.
lr = args.lr
best_val_loss = None

# At any point you can hit Ctrl + C to break out of training early.
try:
    for epoch in range(1, args.epochs + 1):
        epoch_start_time = time.time()
        train()
        val_loss = evaluate(val_data)
        print("-" * 89)
        print("| end of epoch {:3d} | time: {:5.2f}s | valid loss {:8.5f} | "
              "valid ppl {:8.2f}".format(epoch, (time.time() - epoch_start_time),
                                         val_loss, math.exp(val_loss)))
        print("-" * 89)
        # Save the model if the validation loss is the best we've seen so far.
        if not best_val_loss or val_loss < best_val_loss:
            with open(args.save, "wb") as f:
                torch.save(model, f)
            best_val_loss = val_loss
        else:
            # Anneal the learning rate if no improvement has been seen in the validation dataset.
            lr /= 4.0
except KeyboardInterrupt:
    print("-" * 89)
    print("Exiting from training early")

# Load the best saved model (weights_only=True, torch.load's default, with the model's classes
# allowed, as pytorch/examples does).
with open(args.save, "rb") as f:
    safe_globals = [RNNModel, nn.Dropout, nn.Linear, nn.LSTM, nn.GRU, nn.Embedding]
    with torch.serialization.safe_globals(safe_globals):
        model = torch.load(f)
    # after load the rnn params are not a continuous chunk of memory
    # this makes them a continuous chunk, and will speed up forward pass
    model.rnn.flatten_parameters()

print("Loaded model on:", next(model.parameters()).device)

# Run on test data.
test_loss = evaluate(test_data)
print("=" * 89)
print("| End of training | test loss {:8.5f} | test ppl {:8.2f}".format(
    test_loss, math.exp(test_loss)))
print("=" * 89)
